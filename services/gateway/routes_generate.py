"""The generating routes: /v1/completions, /v1/chat/completions and /v1/responses. Each
turns its request into prompts and sampling parameters and hands them to ``generate``,
which submits them and answers as a stream (SSE) or gathered into one response."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway import protocol, response_models as bodies
from services.gateway.choices import ChatChoice, CompletionChoice
from services.gateway.generation import CHOICES, Generation, OutputShape, merge_deltas
from services.gateway.http_input import (
    check_model, config_of, lora_name_of, parse_body, read_json, resolve_max_tokens, service_of,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import json_responses, request_body
from services.gateway.responses import NO_STORE, echo_fields, plan_response
from services.gateway.responses import sampling_params as responses_sampling
from services.gateway.responses_output import responses_shape
from services.gateway.responses_schema import ResponsesRequest, openapi_responses
from services.gateway.routes_responses import StoredSubmission, create_stored
from services.gateway.responses_schema import parse_request as parse_responses_request
from services.gateway.service import GatewayService
from services.gateway.streams import Delta, RequestStream
from services.gateway.structured import response_format_spec
from services.gateway.tool_calls import plan_tools
from shared.errors import FlotillaError, InvalidRequest, check_token_ids
from services.gateway.media import check_image_count, fetch_images
from shared.messages import EncodeRequest, ImageInput, SamplingParams, TokenizerInfo

log = structlog.get_logger()
router = APIRouter()
_ID_PREFIXES = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}


@router.post("/v1/completions", openapi_extra=request_body(protocol.CompletionRequest),
             responses=json_responses(bodies.Completion, stream=bodies.Completion))
async def completions(request: Request) -> Response:
    req = await parse_body(request, protocol.CompletionRequest)
    info = await check_model(request, req.model)
    service = service_of(request)
    num_sequences = req.num_sequences
    # best_of ranks sequences by cumulative logprob: the worker reports them even unasked
    worker_logprobs = req.logprobs if req.logprobs is not None else \
        (0 if num_sequences > req.n else None)
    submissions, choices = [], []
    # choice index: prompt index x sequences per prompt + i
    for prompt in req.prompts_or_document_start(info.document_start_token_id):
        # token ids are checked here: a round trip to the tokenizer would only copy them
        prompt_ids = check_token_ids(prompt, info.vocab_size, "prompt") \
            if isinstance(prompt, list) else await service.encode(EncodeRequest(prompt=prompt))
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), info.max_model_len)
        submissions.append((prompt_ids, req.sampling_params(
            max_tokens, info.vocab_size, defaults=info.generation_defaults,
            logprobs=worker_logprobs,
            prompt_logprobs=req.logprobs if req.echo else None)))
        echo_text = None
        if req.echo:
            echo_text = prompt if isinstance(prompt, str) else await service.decode(prompt_ids)
        choices += [CompletionChoice(len(choices) + i, req.logprobs, echo_text)
                    for i in range(num_sequences)]
    return await generate(request, "completions", req, info, submissions, choices, req.n)


@router.post("/v1/chat/completions", openapi_extra=request_body(protocol.ChatCompletionRequest),
             responses=json_responses(bodies.ChatCompletion, stream=bodies.ChatCompletionChunk))
async def chat_completions(request: Request) -> Response:
    req = await parse_body(request, protocol.ChatCompletionRequest)
    info = await check_model(request, req.model)
    if req.store and not service_of(request).store.enabled:
        raise InvalidRequest(NO_STORE.format(param="store: true"), param="store",
                             code="unsupported_parameter")
    tool_plan = plan_tools(*req.tools_and_choice(), req.parallel_tool_calls)
    structured = tool_plan.structured or response_format_spec(
        req.response_format.as_dict() if req.response_format else None)
    config = config_of(request)
    urls = [url for message in req.messages for url in message.image_urls]
    check_image_count(len(urls), info.accepts_images, config.mm_limits)
    encoded = await service_of(request).encode_reply(EncodeRequest(
        messages=[m.to_message() for m in req.messages], add_generation_prompt=True,
        tools=tool_plan.tools_for_prompt, images=await fetch_images(urls, config)))
    prompt_ids = encoded.token_ids
    max_tokens = resolve_max_tokens(
        req.requested_max_tokens, len(prompt_ids), info.max_model_len,
        default_limit=protocol.default_max_tokens(info.generation_defaults,
                                                  config.max_tokens_default))
    sampling = req.sampling_params(max_tokens, info.vocab_size,
                                   defaults=info.generation_defaults,
                                   logprobs=req.num_logprobs, structured=structured)
    if req.store:  # kept in the response store (routes_responses.py): n is 1
        return await _stored(request, "chat", req, await read_json(request), info,
                             prompt_ids, sampling, encoded.images)
    choices = [ChatChoice(i, req.num_logprobs, tool_plan, _call_id) for i in range(req.n)]
    return await generate(request, "chat", req, info, [(prompt_ids, sampling)], choices,
                          req.n, images=encoded.images)


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest),
             responses=openapi_responses())
async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, run on the chat path (services/gateway/responses.py)."""
    config, service = config_of(request), service_of(request)
    raw = await read_json(request)
    req = parse_responses_request(raw, config.accept_unknown_fields)
    info = await check_model(request, req.model)
    plan = plan_response(req, store_available=service.store.enabled)
    check_image_count(len(plan.image_urls), info.accepts_images, config.mm_limits)
    encoded = await service.encode_reply(EncodeRequest(
        messages=plan.messages, add_generation_prompt=True,
        tools=plan.tool_plan.tools_for_prompt,
        images=await fetch_images(plan.image_urls, config)))
    prompt_ids = encoded.token_ids
    max_tokens = resolve_max_tokens(
        req.max_output_tokens, len(prompt_ids), info.max_model_len,
        param="max_output_tokens", default_limit=protocol.default_max_tokens(
            info.generation_defaults, config.max_tokens_default))
    sampling = responses_sampling(req, plan, max_tokens, info.generation_defaults)
    if req.store or req.background:  # kept in the response store (routes_responses.py)
        return await _stored(request, "responses", req, raw, info, prompt_ids, sampling,
                             encoded.images, echo_fields(req, sampling))
    choice = ChatChoice(0, plan.num_logprobs, plan.tool_plan, _call_id)
    return await generate(request, "responses", req, info, [(prompt_ids, sampling)],
                          [choice], 1, output=responses_shape(echo_fields(req, sampling)),
                          images=encoded.images)


async def _stored(request: Request, kind: str, req, raw: dict, info: TokenizerInfo,
                  prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput],
                  echo: dict | None = None) -> Response:
    """A stored or background response (or stored chat completion): run apart from its
    client, read from the store (``echo``: what a response repeats of its request)."""
    started = time.perf_counter()
    service = service_of(request)
    lora_name = lora_name_of(req.model, info)
    service.metrics.prompt_tokens.inc(len(prompt_ids))
    if lora_name:
        service.metrics.lora_requests.labels(lora_name).inc()
        service.metrics.lora_prompt_tokens.labels(lora_name).inc(len(prompt_ids))

    def drain(stream: RequestStream):
        return merge_deltas([_timed(service.deltas(stream), stream, service.metrics, started,
                                    lora_name)])

    return await create_stored(service, StoredSubmission(
        kind=kind, body=raw, echo=echo or {}, prompt_ids=prompt_ids, sampling=sampling,
        model=lora_name or info.model_name, lora_name=lora_name, session=req.session_key,
        stop=req.stop_strings, priority=req.priority, cache_salt=req.cache_salt,
        images=images, stream=bool(req.stream),
        background=getattr(req, "background", None) is True), drain)


async def generate(request: Request, kind: str, req, info: TokenizerInfo,
                   submissions: list[tuple[list[int], SamplingParams]], choices: list,
                   num_returned: int, output: OutputShape = CHOICES,
                   images: list[ImageInput] | None = None) -> Response:
    """Submit each prompt for len(choices) / len(submissions) sequences and answer with
    all of them (num_returned per prompt), in ``output``'s shape; the response names the
    model the request named (the base model or one of its LoRA adapters)."""
    started = time.perf_counter()
    service = service_of(request)
    num_per_prompt = len(choices) // len(submissions)
    lora_name = lora_name_of(req.model, info)
    model = lora_name or info.model_name
    request_ids, streams = await _submit_all(service, req, submissions, num_per_prompt,
                                             lora_name, images or [])
    if lora_name:
        service.metrics.lora_requests.labels(lora_name).inc()
        service.metrics.lora_prompt_tokens.labels(lora_name).inc(
            sum(len(prompt_ids) for prompt_ids, _ in submissions))
    num_prompt_tokens = sum(len(prompt_ids) for prompt_ids, _ in submissions)
    service.metrics.prompt_tokens.inc(num_prompt_tokens)
    generation = Generation(kind, _ID_PREFIXES[kind] + request_ids[0],
                            model, choices, streams, num_prompt_tokens, num_returned,
                            req.include_usage, req.continuous_usage,
                            num_per_prompt=num_per_prompt)
    for stream in streams:
        stream.wake_at_end = not req.stream
    deltas = merge_deltas([_timed(service.deltas(stream), stream, service.metrics, started,
                                  lora_name) for stream in streams])
    if req.stream:
        return StreamingResponse(output.events(generation, deltas),
                                 media_type="text/event-stream")
    return JSONResponse(await _gather_unless_disconnected(
        request, generation, output.gather(generation, deltas), service))


async def _submit_all(service: GatewayService, req,
                      submissions: list[tuple[list[int], SamplingParams]],
                      num_per_prompt: int, lora_name: str = "",
                      images: list[ImageInput] = ()) -> tuple[list[str], list[RequestStream]]:
    """Submit every prompt: (their request ids, every sequence's stream in order)."""
    request_ids, streams = [], []
    try:
        for prompt_ids, sampling in submissions:
            request_id, prompt_streams = await service.submit(
                prompt_ids, sampling, req.stop_strings, priority=req.priority,
                cache_salt=req.cache_salt, n=num_per_prompt, session=req.session_key,
                lora_name=lora_name, images=list(images))
            request_ids.append(request_id)
            streams += prompt_streams
    except BaseException:
        for stream in streams:  # a later prompt was refused: stop the earlier ones
            service.release(stream)
        raise
    return request_ids, streams


async def _timed(deltas: AsyncIterator[Delta], stream: RequestStream, metrics: GatewayMetrics,
                 started: float, lora_name: str = "") -> AsyncIterator[Delta]:
    """Pass deltas through, recording TTFT, inter-token latency, tokens per chunk and
    delivery lag (the last three for streams, read delta by delta), token counts (also by
    LoRA adapter), and the end (its latency and finish reason)."""
    last = None
    async for delta in deltas:
        now = time.perf_counter()
        if delta.num_new_tokens:
            if last is None:
                metrics.time_to_first_token.observe((stream.first_token_at or now) - started)
            elif not stream.wake_at_end:
                metrics.inter_token_latency.observe(now - last)
            if not stream.wake_at_end:
                metrics.observe_chunk(delta.num_new_tokens, delta.published_at)
            last = now
            metrics.generation_tokens.inc(delta.num_new_tokens)
            if lora_name:
                metrics.lora_generation_tokens.labels(lora_name).inc(delta.num_new_tokens)
        if delta.finish_reason is not None:
            metrics.e2e_latency.observe(now - started)
            metrics.requests_finished.labels(delta.finish_reason).inc()
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


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
