"""The OpenAI-compatible HTTP API (FastAPI). Every request streams internally; a
non-streaming response is the stream gathered up."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import protocol, response_models as bodies
from services.gateway.access import AuthAndCount, error_response
from services.gateway.choices import ChatChoice, CompletionChoice
from services.gateway.config import GatewayConfig
from services.gateway.generation import CHOICES, Generation, OutputShape, merge_deltas
from services.gateway.limits import BodySizeLimit
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import install as install_openapi, json_responses, request_body
from services.gateway.responses import echo_fields, plan_response
from services.gateway.responses import sampling_params as responses_sampling
from services.gateway.responses_output import responses_shape
from services.gateway.responses_schema import ResponsesRequest, openapi_responses
from services.gateway.responses_schema import parse_request as parse_responses_request
from services.gateway.service import GatewayService
from services.gateway.streams import Delta, RequestStream
from services.gateway.structured import response_format_spec
from services.gateway.tool_calls import plan_tools
from shared.bus import Bus
from shared.errors import FlotillaError, InvalidRequest, NotFound, check_token_ids
from shared.messages import EncodeRequest, SamplingParams
from shared.models import resolve_model

log = structlog.get_logger()
_ID_PREFIXES = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}


def load_tokenizer(model: str, cache_dir: str):
    """The served model's tokenizer, for turning output tokens into text here."""
    from transformers import AutoTokenizer  # heavy: only when a gateway starts

    return AutoTokenizer.from_pretrained(str(resolve_model(model, cache_dir).path))


def create_app(config: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()
    state: dict[str, GatewayService] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model, config.cache_dir)
        bus = await Bus.connect(config.nats_url, name=f"gateway-{config.instance_id}")
        service = GatewayService(config, bus, metrics, tokenizer)
        await service.start()
        state["service"] = service
        log.info("gateway_started", host=config.host, port=config.port)
        yield
        await service.stop()
        await bus.close()

    app = FastAPI(title="flotilla", lifespan=lifespan)
    # Pure ASGI middleware only: a BaseHTTPMiddleware (@app.middleware) costs a task
    # switch per streamed chunk, which was a third of the gateway's time at 500 streams.
    app.add_middleware(BodySizeLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(AuthAndCount, api_key=config.api_key, metrics=metrics)
    install_openapi(app)

    def service() -> GatewayService:
        return state["service"]

    @app.exception_handler(FlotillaError)
    async def _flotilla_error(_: Request, exc: FlotillaError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(FlotillaError(str(exc.detail), status=exc.status_code,
                                            type="invalid_request_error"))

    async def check_model(model: str | None):
        info = await service().tokenizer_info()
        if model is not None and model != info.model_name:
            raise NotFound(f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return info

    def parse(model_cls, payload):
        return protocol.parse_request(model_cls, payload, config.accept_unknown_fields)

    def model_card(info) -> dict:
        return {"id": info.model_name, "object": "model", "created": 0, "owned_by": "flotilla",
                "max_model_len": info.max_model_len}

    @app.get("/v1/models", response_model=None,
             responses=json_responses(bodies.ModelList, errors=(401, 503)))
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(await service().tokenizer_info())]}

    @app.get("/v1/models/{model:path}", response_model=None,
             responses=json_responses(bodies.ModelCard, errors=(401, 404, 503)))
    async def retrieve_model(model: str) -> dict:
        return model_card(await check_model(model))

    @app.post("/v1/completions", openapi_extra=request_body(protocol.CompletionRequest),
              responses=json_responses(bodies.Completion, stream=bodies.Completion))
    async def completions(request: Request) -> Response:
        req = parse(protocol.CompletionRequest, await read_json(request))
        info = await check_model(req.model)
        num_sequences = req.num_sequences
        # best_of ranks sequences by cumulative logprob: the worker reports them even unasked
        worker_logprobs = req.logprobs if req.logprobs is not None else \
            (0 if num_sequences > req.n else None)
        submissions, choices = [], []
        # choice index: prompt index x sequences per prompt + i
        for prompt in req.prompts_or_document_start(info.document_start_token_id):
            # token ids are checked here: a round trip to the tokenizer would only copy them
            prompt_ids = check_token_ids(prompt, info.vocab_size, "prompt") \
                if isinstance(prompt, list) else await service().encode(EncodeRequest(prompt=prompt))
            max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), info.max_model_len)
            submissions.append((prompt_ids, req.sampling_params(
                max_tokens, info.vocab_size, defaults=info.generation_defaults,
                logprobs=worker_logprobs,
                prompt_logprobs=req.logprobs if req.echo else None)))
            echo_text = None
            if req.echo:
                echo_text = prompt if isinstance(prompt, str) else \
                    await service().decode(prompt_ids)
            choices += [CompletionChoice(len(choices) + i, req.logprobs, echo_text)
                        for i in range(num_sequences)]
        return await generate(request, "completions", req, info.model_name, submissions,
                              choices, req.n)

    @app.post("/v1/chat/completions", openapi_extra=request_body(protocol.ChatCompletionRequest),
              responses=json_responses(bodies.ChatCompletion, stream=bodies.ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        req = parse(protocol.ChatCompletionRequest, await read_json(request))
        info = await check_model(req.model)
        tool_plan = plan_tools(*req.tools_and_choice(), req.parallel_tool_calls)
        structured = tool_plan.structured or response_format_spec(
            req.response_format.as_dict() if req.response_format else None)
        prompt_ids = await service().encode(EncodeRequest(
            messages=[m.to_message() for m in req.messages], add_generation_prompt=True,
            tools=tool_plan.tools_for_prompt))
        max_tokens = resolve_max_tokens(
            req.requested_max_tokens, len(prompt_ids), info.max_model_len,
            default_limit=protocol.default_max_tokens(info.generation_defaults,
                                                      config.max_tokens_default))
        sampling = req.sampling_params(max_tokens, info.vocab_size,
                                       defaults=info.generation_defaults,
                                       logprobs=req.num_logprobs, structured=structured)
        choices = [ChatChoice(i, req.num_logprobs, tool_plan, _call_id) for i in range(req.n)]
        return await generate(request, "chat", req, info.model_name, [(prompt_ids, sampling)],
                              choices, req.n)

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest),
              responses=openapi_responses())
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, run on the chat path (services/gateway/responses.py)."""
        req = parse_responses_request(await read_json(request), config.accept_unknown_fields)
        info = await check_model(req.model)
        plan = plan_response(req)
        prompt_ids = await service().encode(EncodeRequest(
            messages=plan.messages, add_generation_prompt=True,
            tools=plan.tool_plan.tools_for_prompt))
        max_tokens = resolve_max_tokens(
            req.max_output_tokens, len(prompt_ids), info.max_model_len,
            param="max_output_tokens", default_limit=protocol.default_max_tokens(
                info.generation_defaults, config.max_tokens_default))
        sampling = responses_sampling(req, plan, max_tokens, info.generation_defaults)
        choice = ChatChoice(0, plan.num_logprobs, plan.tool_plan, _call_id)
        return await generate(request, "responses", req, info.model_name,
                              [(prompt_ids, sampling)], [choice], 1,
                              output=responses_shape(echo_fields(req, sampling)))

    async def generate(request: Request, kind: str, req, model: str,
                       submissions: list[tuple[list[int], SamplingParams]], choices: list,
                       num_returned: int, output: OutputShape = CHOICES) -> Response:
        """Submit each prompt for len(choices) / len(submissions) sequences and answer with
        all of them (num_returned per prompt), in ``output``'s shape."""
        started = time.perf_counter()
        num_per_prompt = len(choices) // len(submissions)
        request_ids, streams = [], []
        try:
            for prompt_ids, sampling in submissions:
                request_id, prompt_streams = await service().submit(
                    prompt_ids, sampling, req.stop_strings, priority=req.priority,
                    cache_salt=req.cache_salt, n=num_per_prompt, session=req.session_key)
                request_ids.append(request_id)
                streams += prompt_streams
        except BaseException:
            for stream in streams:  # a later prompt was refused: stop the earlier ones
                service().release(stream)
            raise
        num_prompt_tokens = sum(len(prompt_ids) for prompt_ids, _ in submissions)
        metrics.prompt_tokens.inc(num_prompt_tokens)
        generation = Generation(kind, _ID_PREFIXES[kind] + request_ids[0],
                                model, choices, streams, num_prompt_tokens, num_returned,
                                req.include_usage, num_per_prompt=num_per_prompt)
        for stream in streams:
            stream.wake_at_end = not req.stream
        deltas = merge_deltas([_timed(service().deltas(stream), stream, metrics, started)
                               for stream in streams])
        if req.stream:
            return StreamingResponse(output.events(generation, deltas),
                                     media_type="text/event-stream")
        return JSONResponse(await _gather_unless_disconnected(
            request, generation, output.gather(generation, deltas), service()))

    @app.post("/tokenize", openapi_extra=request_body(protocol.TokenizeRequest),
              response_model=None, responses=json_responses(bodies.TokenizeResponse))
    async def tokenize(request: Request) -> dict:
        req = parse(protocol.TokenizeRequest, await read_json(request))
        info = await check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        messages = [m.to_message() for m in req.messages] if req.messages is not None else None
        token_ids = await service().encode(EncodeRequest(
            prompt=req.prompt, messages=messages, add_special_tokens=req.add_special_tokens,
            add_generation_prompt=req.add_generation_prompt,
            tools=plan_tools(req.tool_dicts(), None, None).tools_for_prompt if req.tools else None))
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": info.max_model_len}

    @app.post("/detokenize", openapi_extra=request_body(protocol.DetokenizeHTTPRequest),
              response_model=None, responses=json_responses(bodies.DetokenizeResponse))
    async def detokenize(request: Request) -> dict:
        req = parse(protocol.DetokenizeHTTPRequest, await read_json(request))
        await check_model(req.model)
        return {"prompt": await service().decode(req.tokens)}

    async def readiness() -> dict:
        """Every tier answers, and at least one replica is ready (its worker attached and
        stepping whenever it has work)."""
        gateway = service()
        services = {"gateway": {"status": "ok", "instance_id": config.instance_id},
                    **await gateway.health()}
        replicas = {stats.replica_id: {"scheduler_id": stats.scheduler_id,
                                       "ready": gateway.is_ready(stats),
                                       "worker_ready": stats.worker_ready,
                                       "seconds_since_step": round(
                                           gateway.seconds_since_step(stats.scheduler_id), 1),
                                       "num_running": stats.num_running,
                                       "num_waiting": stats.num_waiting,
                                       "block_index_synced": gateway.index.is_synced(
                                           stats.scheduler_id)}
                    for stats in gateway.live_schedulers()}
        ready = all(s["status"] == "ok" for s in services.values()) and \
            any(r["ready"] for r in replicas.values())
        return {"status": "ok" if ready else "unavailable", "live": True, "ready": ready,
                "services": services, "replicas": replicas}

    @app.get("/health", responses={200: {"model": bodies.HealthReport},
                                   503: {"model": bodies.HealthReport}})
    async def health() -> JSONResponse:
        """Everything: each service's answer and each replica's readiness (503 unless ready)."""
        report = await readiness()
        return JSONResponse(status_code=200 if report["ready"] else 503, content=report)

    @app.get("/health/ready", responses={200: {"model": bodies.Readiness},
                                         503: {"model": bodies.Readiness}})
    async def health_ready() -> JSONResponse:
        """Readiness probe: send traffic here (the same verdict as /health)."""
        report = await readiness()
        return JSONResponse(status_code=200 if report["ready"] else 503,
                            content={"ready": report["ready"], "status": report["status"]})

    @app.get("/health/live", response_model=None,
             responses={200: {"model": bodies.Liveness}})
    async def health_live() -> dict:
        """Liveness probe: the gateway process serves HTTP, whatever the other tiers do."""
        return {"live": True}

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                          "description": "Prometheus text format"}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(_read_restarts(config.restarts_file)),
                        media_type="text/plain; version=0.0.4")

    return app


async def read_json(request: Request):
    body = await request.body()
    try:  # msgspec first: a 16k-id prompt parses in ~0.4 ms instead of ~1.2 ms
        payload = msgspec.json.decode(body)
    except (ValueError, RecursionError):  # msgspec's errors: json's own message, as before
        payload = _json_loads_or_400(body)
    if not isinstance(payload, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return payload


def _json_loads_or_400(body: bytes):
    """The body as the standard library reads it (it also takes what msgspec refuses:
    NaN, Infinity, lone surrogate escapes, numbers out of a float's range), or the 400
    that names why it is not JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    return payload


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       param: str = "max_tokens",
                       default_limit: int | None = None) -> int:
    """The request's own limit, which must fit the context; without one, ``default_limit``
    (protocol.default_max_tokens) or the room the prompt leaves, whichever is less."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        if room < 1:
            raise InvalidRequest(
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room in the model's "
                f"context length of {max_model_len}", param="messages",
                code="context_length_exceeded")
        return min(room, default_limit) if default_limit else room
    if requested > room:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion).", param=param,
            code="context_length_exceeded")
    return requested


async def _timed(deltas: AsyncIterator[Delta], stream: RequestStream, metrics: GatewayMetrics,
                 started: float) -> AsyncIterator[Delta]:
    """Pass deltas through, recording TTFT, inter-token latency (streams read delta by
    delta only) and token counts."""
    last = None
    async for delta in deltas:
        now = time.perf_counter()
        if delta.num_new_tokens:
            if last is None:
                metrics.time_to_first_token.observe((stream.first_token_at or now) - started)
            elif not stream.wake_at_end:
                metrics.inter_token_latency.observe(now - last)
            last = now
            metrics.generation_tokens.inc(delta.num_new_tokens)
        if delta.finish_reason is not None:
            metrics.e2e_latency.observe(now - started)
        yield delta


async def _gather_unless_disconnected(request: Request, generation: Generation,
                                      gathering: Awaitable[dict],
                                      service: GatewayService) -> dict:
    """The gathered response; if the client goes away first, abort every sequence."""
    task = asyncio.ensure_future(gathering)
    gone = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        log.info("client_disconnected", response_id=generation.response_id)
        task.cancel()
        for stream in generation.streams:
            service.release(stream)
        raise FlotillaError("client disconnected", status=499)
    finally:
        task.cancel()
        gone.cancel()


async def _client_gone(request: Request) -> None:
    """Return once the client disconnects. The body has been read, so the next ASGI
    message is the disconnect: no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _read_restarts(path: str) -> dict[str, int]:
    """The launcher's restart counts ({} when there is no launcher or no file yet)."""
    if not path:
        return {}
    try:
        counts = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in counts.items()} if isinstance(counts, dict) else {}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
