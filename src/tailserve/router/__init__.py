"""Multi-replica load balancing: an OpenAI-compatible front that places each request on a replica.

Talks HTTP only; it must never import the engine, the model, the server or torch.
"""

from tailserve.router.config import POLICIES, RouterConfig

__all__ = ["POLICIES", "RouterConfig"]
