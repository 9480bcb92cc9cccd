"""The OpenAI-compatible HTTP API (FastAPI) in front of a GatewayService. Every request
streams internally; a non-streaming response is the stream gathered up.

The caller builds the service (__main__.py: ``GatewayService.connect``) and hands it
over; the app starts and stops it with its own lifespan. The routes (routes_generate.py,
routes_info.py) reach it through ``request.app.state`` (http_input.py), so a test can
give the app a stand-in and drive it over HTTP with no NATS.
"""

from __future__ import annotations

import inspect
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import routes_generate, routes_info, routes_lora, routes_responses
from services.gateway.access import AuthAndCount, error_response
from services.gateway.config import GatewayConfig
from services.gateway.http_spans import HttpSpans
from services.gateway.limits import BodySizeLimit
from services.gateway.openapi import install as install_openapi
from services.gateway.service import GatewayService
from shared.errors import FlotillaError
from shared.runtime import log_startup
from shared.tracing import spans_enabled

log = structlog.get_logger()
# FastAPI (0.16x) makes HTTP and per-dependency spans of its own once a tracer provider is
# installed: a second root beside HttpSpans' in each request (and a cost per dependency).
# flotilla makes its own (docs/tracing.md); older FastAPI has no such knob and no such spans.
_NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "operation_spans": False,
                                       "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI).parameters else {})


def create_app(config: GatewayConfig, service: GatewayService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await service.start()
        log.info("gateway_started", host=config.host, port=config.port)
        log_startup("serving")
        yield
        await service.stop()

    app = FastAPI(title="flotilla", lifespan=lifespan, **_NO_NATIVE_TELEMETRY)
    app.state.config, app.state.service = config, service
    # Pure ASGI middleware only: a BaseHTTPMiddleware (@app.middleware) costs a task
    # switch per streamed chunk, which was a third of the gateway's time at 500 streams.
    app.add_middleware(BodySizeLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(AuthAndCount, api_key=config.api_key, metrics=service.metrics)
    if spans_enabled():  # outermost: the root span of each request's trace
        app.add_middleware(HttpSpans)
    install_openapi(app)
    app.add_exception_handler(FlotillaError, _flotilla_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(routes_info.models)
    app.include_router(routes_generate.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_info.router)
    app.include_router(routes_lora.router)
    return app


async def _flotilla_error(_: Request, exc: FlotillaError) -> JSONResponse:
    return error_response(exc)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(FlotillaError(str(exc.detail), status=exc.status_code,
                                        type="invalid_request_error"))
