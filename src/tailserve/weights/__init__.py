"""tailserve.weights: what a model file holds: its architecture, weights (GGUF, HF safetensors,
dummy), tokenizer and the int4 / int8 groups the kernels run. Reads files; never builds a model.
"""
