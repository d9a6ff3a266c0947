"""The worker routes SGLang's model gateway (`sglang-router` 0.3.2) calls on each worker besides the
OpenAI ones: what it reads to register a worker (/server_info, /model_info, and their legacy
/get_ names), its load (/get_load, a per-rank array summed over `num_tokens`), and the cache flush
it broadcasts (/flush_cache). Answers from the engine's published stats; never blocks a step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailserve import __version__
from tailserve.errors import ConflictError
from tailserve.http.errors import ServiceUnavailableError
from tailserve.server.engine_api import Engine

FLUSH_TIMEOUT_S = 30.0  # the engine thread answers between steps; a stopped one never does


def server_info(engine: Engine) -> dict[str, Any]:
    """SGLang's /server_info, the fields the gateway reads (model_path, served_model_name, dp_size,
    version, max_total_tokens, max_prefill_tokens, max_running_requests) and a few of SGLang's own
    names for the same limits."""
    cfg = engine.config
    block_size = cfg.cache.block_size
    max_total_tokens = engine.stats().kv_blocks_total * block_size
    return {
        "model_path": cfg.model.model,
        "tokenizer_path": cfg.model.model,
        "served_model_name": engine.model_name,
        "version": f"tailserve-{__version__}",
        "dp_size": 1,
        "tp_size": cfg.model.tensor_parallel_size,
        "max_total_tokens": max_total_tokens,
        "max_total_num_tokens": max_total_tokens,
        "max_prefill_tokens": cfg.scheduler.max_num_batched_tokens,
        "chunked_prefill_size": cfg.scheduler.max_num_batched_tokens,
        "max_running_requests": cfg.scheduler.max_num_seqs,
        "context_length": engine.max_model_len,
        "page_size": block_size,
        "disable_radix_cache": not cfg.cache.enable_prefix_caching,
        "is_embedding": False,
    }


def model_info(engine: Engine) -> dict[str, Any]:
    """SGLang's /model_info: the gateway keeps model_type and architectures as labels when given
    (tailserve does not surface the Hugging Face config: null)."""
    return {
        "model_path": engine.config.model.model,
        "tokenizer_path": engine.config.model.model,
        "is_generation": True,
        "model_type": None,
        "architectures": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def load(engine: Engine) -> list[dict[str, int]]:
    """SGLang's /get_load: one entry per data-parallel rank (tailserve: one). The gateway's load is the
    sum of `num_tokens`: here the KV tokens held by requests (queued prompts hold none yet)."""
    s = engine.stats()
    return [
        {
            "dp_rank": 0,
            "num_reqs": s.num_running + s.num_waiting,
            "num_waiting_reqs": s.num_waiting,
            "num_tokens": s.kv_blocks_used * engine.config.cache.block_size,
        }
    ]


def worker_routes(engine: Engine) -> APIRouter:
    """The routes above, on their own router (mounted by create_app)."""
    router = APIRouter()

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def get_server_info() -> Response:
        return JSONResponse(server_info(engine))

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse(model_info(engine))

    @router.get("/get_load")
    async def get_load() -> Response:
        return JSONResponse(load(engine))

    @router.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Empty the prefix cache; 409 while requests are queued or running unless `?force=true`."""
        force = request.query_params.get("force", "").lower() in ("1", "true", "yes")
        try:
            flushed = await asyncio.wait_for(engine.flush_prefix_cache(force), FLUSH_TIMEOUT_S)
        except TimeoutError:
            raise ServiceUnavailableError("not_ready") from None
        if not flushed:
            raise ConflictError(
                "the prefix cache was not flushed: requests are queued or running; "
                "retry when idle or pass ?force=true",
                "requests_in_flight",
            )
        return JSONResponse({"flushed": True})

    return router
