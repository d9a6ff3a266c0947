"""tailserve's prefix- and load-aware placement (router.policies.PrefixAffinity, the policy
`tailserve route --policy prefix` runs) as a Ray Serve request router, for the engine deployment;
and Ray Serve LLM's PrefixCacheAffinityRouter made usable on it (PrefixCacheRouter).

Built on Ray's alpha `RequestRouter` API (ray[serve] pinned at 2.60.0). A replica's load is its
ongoing requests as Ray counts them (fresh: Ray adds each request it sends); the prompt comes from
the ingress's `HttpCall.route`. State is per ingress replica, as with several `tailserve route`s.
"""

from __future__ import annotations

from typing import Any, cast

# Ray Serve LLM's router itself: its public path (ray.serve.llm.request_router) is a bare subclass of
# this one whose package refuses to import without vLLM or SGLang installed; this path needs neither.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
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


class PrefixCacheRouter(PrefixCacheAffinityRouter):  # type: ignore[misc]
    """Ray Serve LLM's PrefixCacheAffinityRouter, unchanged: it reads the `prompt` of the call's
    HttpCall (HttpCall.prompt). A call with no prompt text (a GET, a body that is not an OpenAI
    request) goes by power of two choices, since Ray's router divides by the prompt's length."""

    # Ray's router is annotated as returning list[RunningReplica]; it returns ranks, list[list[...]].
    async def choose_replicas(  # type: ignore[override]
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        route = route_of(pending_request)
        if route is None or not route.prompt_text:
            power_of_two = PowerOfTwoChoicesRequestRouter.choose_replicas
            return await power_of_two(self, candidate_replicas, pending_request)  # type: ignore[arg-type]
        return cast(
            list[list[RunningReplica]], await super().choose_replicas(candidate_replicas, pending_request)
        )

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Ray's router inserts the prompt into its prefix tree; nothing to insert without one."""
        route = route_of(pending_request)
        if route is not None and route.prompt_text:
            super().on_request_routed(pending_request, replica_id, result)
