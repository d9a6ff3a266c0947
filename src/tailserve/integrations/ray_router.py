"""tailserve's prefix- and load-aware placement (router.policies.PrefixAffinity, the policy
`tailserve route --policy prefix` runs) as a Ray Serve request router, for the engine deployment.

Built on Ray's alpha `RequestRouter` API (ray[serve] pinned at 2.60.0). A replica's load is its
ongoing requests as Ray counts them (fresh: Ray adds each request it sends); the prompt comes from
the ingress's `HttpCall.route`. State is per ingress replica, as with several `tailserve route`s.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tailserve.integrations.asgi_call import HttpCall
from tailserve.router.policies import Candidate, RouteRequest, make_policy

NO_PROMPT = RouteRequest(session_key=None, prompt_text="")  # placed by load alone


def route_of(pending: PendingRequest | None) -> RouteRequest | None:
    """What placement reads of a `forward` call: its HttpCall's route (None for other calls)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], HttpCall):
        return None
    return pending.args[0].route


class PrefixLoadRouter(RequestRouter):  # type: ignore[misc]
    """The replica holding the request's longest prompt prefix, unless it has more than
    `load_bound` requests over the least loaded; else the least loaded. Ranks the rest by load."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`block_chars`, `load_bound`, `max_blocks` (RequestRouterConfig.request_router_kwargs):
        PrefixAffinity's, with `tailserve route`'s defaults."""
        self._policy = make_policy("prefix", **kwargs)

    def load(self, replica: RunningReplica) -> float:
        """The replica's ongoing requests as Ray last counted them (0 before the first count)."""
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        return float(ongoing or 0)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """[[the policy's choice], the others, least loaded first]."""
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [Candidate(key, self.load(r)) for key, r in by_id.items()]
        decision = self._policy.choose(route_of(pending_request) or NO_PROMPT, candidates)
        rest = sorted((c for c in candidates if c.url != decision.url), key=lambda c: c.load)
        ranks = [[by_id[decision.url]]]
        if rest:
            ranks.append([by_id[c.url] for c in rest])
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica now caches this prompt's blocks."""
        route = route_of(pending_request)
        if route is not None:
            self._policy.record(route, replica_id.unique_id)
