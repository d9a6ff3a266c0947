"""tailserve against its peers on one CPU box (`python benchmarks/compare_engines.py`):
records (what is measured), run (measuring one server), report (markdown), cli.
"""
