"""tailserve.server: the OpenAI-compatible HTTP API (validation, admission, SSE, errors mapped in one
place, Prometheus metrics) over the engine's AsyncEngine; graceful drain on shutdown."""
