"""tailserve.http: the HTTP plumbing the server and the router share: OpenAI error JSON and the one
mapping of typed errors to status codes, JSON bodies, middleware (API key, body limits, error
counts), SSE, and serving an ASGI app under uvicorn until drained. Knows no engine and no router.
"""
