"""tailserve: an LLM inference server built for low, steady tail latency."""

__version__ = "0.1.0"
