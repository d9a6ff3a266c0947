"""The FastAPI app: routes, lifespan (engine start, warm-up, shutdown), middleware, error mapping.

`create_app(engine, config)` builds everything from its arguments and keeps no global state, so two
apps can live in one process; request handling itself lives in serving.py.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tailserve
from tailserve.engine.request import SamplingParams
from tailserve.errors import RequestRejectedError, TailserveError
from tailserve.http.errors import (
    HTTPError,
    ModelNotFoundError,
    ServiceUnavailableError,
    route_error,
    to_http,
)
from tailserve.http.json_body import parse_json
from tailserve.http.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    CatchAllMiddleware,
    ErrorCountMiddleware,
    JsonContentTypeMiddleware,
)
from tailserve.server import responses_api
from tailserve.server.admission import Admission, WaitCorrection
from tailserve.server.config import ServerConfig
from tailserve.server.engine_api import Engine
from tailserve.server.metrics import ProtocolLabels, ServerMetrics
from tailserve.server.openapi import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResponseObject,
    Status,
    TokenizeResponse,
    Version,
    build_openapi,
    error_responses,
)
from tailserve.server.request_ids import RequestIdMiddleware
from tailserve.server.serving import Serving
from tailserve.server.sglang_worker import worker_routes
from tailserve.server.slo_classes import SloClasses
from tailserve.server.tokenize import detokenize, tokenize

log = logging.getLogger("tailserve.server")
WARMUP_PROMPT = "Hello! Say something short."


@dataclass
class ServerState:
    """Everything one app owns; reachable as `app.state.tailserve` (lifecycle.py drains through it)."""

    engine: Engine
    config: ServerConfig
    admission: Admission
    metrics: ServerMetrics
    started_at: int


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """A ready-to-serve ASGI app around an engine that is constructed but not yet started.
    ConfigError where `config.slo_classes` is tighter than the engine was built for."""
    if config.slo_classes is not None:
        config.slo_classes.check_engine(engine.config.scheduler)
    admission = Admission(engine, WaitCorrection(enabled=config.admission_correction))
    protocol = ProtocolLabels(engine.model_name, engine.config.cache)
    metrics = ServerMetrics(engine.stats, lambda: admission.serving, protocol)
    metrics.admission_correction.set_function(admission.correction.factor)
    state = ServerState(engine, config, admission, metrics, int(time.time()))
    slo_classes = config.slo_classes or SloClasses.builtin(engine.config.scheduler)
    serving = Serving(
        engine,
        admission,
        metrics,
        config.max_tokens_default,
        config.generation,
        slo_classes,
        cache_salt_from_api_key=config.cache_salt_from_api_key,
        trust_request_slo=config.trust_request_slo,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info(
            "requests without max_tokens get at most %d tokens (--max-tokens-default); "
            "the model's sampling defaults: %s",
            config.max_tokens_default,
            config.generation.describe(),
        )
        warmup = asyncio.create_task(_warm_up(state))
        try:
            yield
        finally:
            admission.begin_drain()
            warmup.cancel()
            await asyncio.gather(warmup, return_exceptions=True)
            await engine.shutdown()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN, which a closed network lacks.
    openapi_url = "/openapi.json" if config.openapi else None
    app = FastAPI(
        title="tailserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=openapi_url
    )
    app.openapi = functools.partial(build_openapi, app)  # type: ignore[method-assign]
    app.state.tailserve = state
    generation_errors = error_responses()
    v1_errors = error_responses("400", "401", "404", "500")
    tokenizer_errors = error_responses("400", "404", "413", "415", "500")

    def error_response(exc: BaseException) -> Response:
        if isinstance(exc, RequestRejectedError | ServiceUnavailableError):
            metrics.rejected.labels(reason=exc.reason).inc()
        return _json_error(to_http(exc))

    async def on_tailserve_error(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_http_exception(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _json_error(route_error(exc.status_code, str(exc.detail), exc.headers))

    app.add_exception_handler(TailserveError, on_tailserve_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    # add_middleware wraps outward: the last added runs first. So: count every error status, refuse
    # oversized bodies (413 before 401), then wrong content types, then a wrong key; any other
    # exception becomes a 500 inside the counter.
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, extra_keys=tuple(slo_classes.api_keys))
    app.add_middleware(JsonContentTypeMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(ErrorCountMiddleware, errors=metrics.errors)
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries its X-Request-Id

    @app.post("/v1/completions", response_model=CompletionResponse, responses=generation_errors)
    async def completions(request: Request) -> Response:
        return await serving.handle("completion", request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=generation_errors)
    async def chat_completions(request: Request) -> Response:
        return await serving.handle("chat", request)

    @app.post("/v1/responses", response_model=ResponseObject, responses=generation_errors)
    async def create_response(request: Request) -> Response:
        return await responses_api.handle(serving, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=tokenizer_errors)
    async def tokenize_text(request: Request) -> Response:
        model, body = tokenize(parse_json(await request.body()), engine.tokenizer, engine.max_model_len)
        _check_model(model)
        return JSONResponse(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=tokenizer_errors)
    async def detokenize_ids(request: Request) -> Response:
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        model, body = detokenize(parse_json(await request.body()), engine.tokenizer, vocab)
        _check_model(model)
        return JSONResponse(body)

    def _check_model(model: str) -> None:
        if model != engine.model_name:
            raise ModelNotFoundError(model, engine.model_name)

    @app.get("/v1/models", response_model=ModelList, responses=v1_errors)
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=v1_errors)
    async def get_model(model_id: str) -> Response:
        if model_id != engine.model_name:
            raise ModelNotFoundError(model_id, engine.model_name)
        return JSONResponse(_model_card(state))

    @app.get("/version", response_model=Version)
    async def version() -> Response:
        return JSONResponse({"version": tailserve.__version__})

    @app.get("/health", response_model=Status)
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get(
        "/ready",
        response_model=Status,
        responses={503: {"model": Status, "description": "warming up or draining"}},
    )
    async def ready() -> Response:
        if admission.serving:
            return JSONResponse({"status": "ready"})
        status = "draining" if admission.draining else "not_ready"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(worker_routes(engine))  # SGLang's gateway: server/sglang_worker.py
    return app


def _json_error(error: HTTPError) -> Response:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def _model_card(state: ServerState) -> dict[str, object]:
    return {
        "id": state.engine.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "tailserve",
        "max_model_len": state.engine.max_model_len,
        "max_tokens_default": state.config.max_tokens_default,
    }


async def _warm_up(state: ServerState) -> None:
    """One short generation through the whole stack before /ready turns 200; kept out of the metrics."""
    engine = state.engine
    try:
        if state.config.warmup:
            ids = engine.tokenizer.encode(WARMUP_PROMPT)
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(f"warmup-{uuid.uuid4().hex}", ids, params):
                pass
            await _settle(engine)
        _freeze_startup_heap()
        state.metrics.exclude_warmup()
        state.admission.ready = True
        log.info("model %s warmed up; ready", engine.model_name)
    except Exception:
        log.exception("warm-up failed; /ready stays 503")


def _freeze_startup_heap() -> None:
    """Move what start-up made (modules, the tokenizer's vocabulary, the weights' wrappers, the app)
    out of the collector's reach: a full collection walks every tracked object and stops every thread
    that wants the GIL meanwhile, so walking these on each one is a gap in every stream, for objects
    that live as long as the server (as vLLM and SGLang do after start-up)."""
    gc.collect()
    gc.freeze()


async def _settle(engine: Engine, timeout_s: float = 2.0) -> None:
    """Wait until the engine's stats show no request, so the warm-up's counters are all in the baseline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.01)
