"""The servers benchmarks compare tailserve with: their virtual environments, model files and
command lines. Standard library only (run from any venv); tailserve is reached through subprocesses.
"""
