"""tailserve.model: weight loading (GGUF, HF safetensors, dummy), weight formats and their kernels, the
transformer, attention backends, the sampler, the quality gate and the model runner over its KV pool."""
