"""tailserve against its peers on one CPU box (`python benchmarks/compare_engines.py`): stats
(intervals, verdicts), plan (workloads, sizes, capacity search), analyze (one bench run), store
(checkpoints), run (servers and phases), report and plots (markdown, SVG), cli; and fast_path, one
stream and sixteen against the same peers (`compare_engines.py fast-path`).
"""
