"""tailserve.executor: the model runner over its preallocated KV pool, how it is built (device,
threads, pool size, CUDA graphs, tensor-parallel workers) and warmed up. Never schedules.
"""
