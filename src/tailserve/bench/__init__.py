"""tailserve.bench: an SLA load generator for any OpenAI-compatible server (HTTP only).

It never imports the engine, the model or the server; see docs/BENCH.md for usage and the result schema.
"""
