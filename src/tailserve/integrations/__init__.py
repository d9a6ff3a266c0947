"""Glue for the scale-out engines users already run (Ray Serve); each module imports its engine."""
