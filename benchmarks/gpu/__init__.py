"""The GPU suite (`python benchmarks/gpu_suite.py`): suite (sizes, result document, budget),
in_process (bandwidth, decode steps, offline; graphs vs eager), hf_worker (transformers), online.
"""
