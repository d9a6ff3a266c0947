"""tailserve.model: the transformer in each weight format's kernel plan, its linear layers, attention
backends, the fused CPU forward, tensor-parallel sharding and the sampler. Holds no KV pool.
"""
