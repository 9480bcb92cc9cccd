"""The routes that generate nothing: the model list, /tokenize and /detokenize, the health
probes and /metrics."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway import protocol, response_models as bodies
from services.gateway.http_input import check_model, config_of, parse_body, service_of
from services.gateway.openapi import json_responses, request_body
from services.gateway.tool_calls import plan_tools
from shared.errors import InvalidRequest
from shared.lora_adapters import LoraRef
from shared.messages import EncodeRequest, TokenizerInfo

models = APIRouter()  # registered before the generating routes, the rest after
router = APIRouter()


def _model_card(info: TokenizerInfo, lora: LoraRef | None = None) -> dict:
    """The base model's card, or (``lora``) one of its LoRA adapters' with its parent."""
    card = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "flotilla",
            "max_model_len": info.max_model_len,
            "input_modalities": ["text", "image"] if info.accepts_images else ["text"]}
    if lora is not None:
        card |= {"id": lora.name, "root": lora.path, "parent": info.model_name}
    return card


@models.get("/v1/models", response_model=None,
            responses=json_responses(bodies.ModelList, errors=(401, 503)))
async def list_models(request: Request) -> dict:
    """The base model, then its LoRA adapters (by name)."""
    service = service_of(request)
    info = await service.tokenizer_info()
    adapters = sorted(service.lora_adapters().values(), key=lambda ref: ref.name)
    return {"object": "list", "data": [_model_card(info)] + [
        _model_card(info, lora) for lora in adapters]}


@models.get("/v1/models/{model:path}", response_model=None,
            responses=json_responses(bodies.ModelCard, errors=(401, 404, 503)))
async def retrieve_model(request: Request, model: str) -> dict:
    info = await check_model(request, model)
    return _model_card(info, service_of(request).lora_ref(model))


@router.post("/tokenize", openapi_extra=request_body(protocol.TokenizeRequest),
             response_model=None, responses=json_responses(bodies.TokenizeResponse))
async def tokenize(request: Request) -> dict:
    req = await parse_body(request, protocol.TokenizeRequest)
    info = await check_model(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
    messages = [m.to_message() for m in req.messages] if req.messages is not None else None
    token_ids = await service_of(request).encode(EncodeRequest(
        prompt=req.prompt, messages=messages, add_special_tokens=req.add_special_tokens,
        add_generation_prompt=req.add_generation_prompt,
        tools=plan_tools(req.tool_dicts(), None, None).tools_for_prompt if req.tools else None))
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": info.max_model_len}


@router.post("/detokenize", openapi_extra=request_body(protocol.DetokenizeHTTPRequest),
             response_model=None, responses=json_responses(bodies.DetokenizeResponse))
async def detokenize(request: Request) -> dict:
    req = await parse_body(request, protocol.DetokenizeHTTPRequest)
    await check_model(request, req.model)
    return {"prompt": await service_of(request).decode(req.tokens)}


async def readiness(request: Request) -> dict:
    """Every tier answers, and at least one replica is ready (its worker attached and
    stepping whenever it has work)."""
    service = service_of(request)
    services = {"gateway": {"status": "ok", "instance_id": config_of(request).instance_id},
                **await service.health()}
    replicas = service.replica_readiness()
    ready = all(s["status"] == "ok" for s in services.values()) and \
        any(r["ready"] for r in replicas.values())
    return {"status": "ok" if ready else "unavailable", "live": True, "ready": ready,
            "services": services, "replicas": replicas}


@router.get("/health", responses={200: {"model": bodies.HealthReport},
                                  503: {"model": bodies.HealthReport}})
async def health(request: Request) -> JSONResponse:
    """Everything: each service's answer and each replica's readiness (503 unless ready)."""
    report = await readiness(request)
    return JSONResponse(status_code=200 if report["ready"] else 503, content=report)


@router.get("/health/ready", responses={200: {"model": bodies.Readiness},
                                        503: {"model": bodies.Readiness}})
async def health_ready(request: Request) -> JSONResponse:
    """Readiness probe: send traffic here (the same verdict as /health)."""
    report = await readiness(request)
    return JSONResponse(status_code=200 if report["ready"] else 503,
                        content={"ready": report["ready"], "status": report["status"]})


@router.get("/health/live", response_model=None,
            responses={200: {"model": bodies.Liveness}})
async def health_live() -> dict:
    """Liveness probe: the gateway process serves HTTP, whatever the other tiers do."""
    return {"live": True}


@router.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                         "description": "Prometheus text format"}})
async def prometheus_metrics(request: Request) -> Response:
    restarts = _read_restarts(config_of(request).restarts_file)
    return Response(service_of(request).metrics.render(restarts),
                    media_type="text/plain; version=0.0.4")


def _read_restarts(path: str) -> dict[str, int]:
    """The launcher's restart counts ({} when there is no launcher or no file yet)."""
    if not path:
        return {}
    try:
        counts = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in counts.items()} if isinstance(counts, dict) else {}
