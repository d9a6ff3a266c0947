"""tailserve.engine."""
