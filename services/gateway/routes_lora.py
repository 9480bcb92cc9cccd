"""vLLM's run-time LoRA endpoints (docs/lora.md): load an adapter on every live replica,
or unload it. The answers are vLLM's: plain-text success, OpenAI errors otherwise (400 for
a bad adapter, naming what is wrong; 404 for an unknown one)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from services.gateway import protocol
from services.gateway.http_input import parse_body, service_of
from services.gateway.openapi import request_body
from shared.errors import InvalidRequest

router = APIRouter()
_TEXT = {200: {"description": "done", "content": {"text/plain": {"schema": {"type": "string"}}}}}


@router.post("/v1/load_lora_adapter", openapi_extra=request_body(
    protocol.LoadLoraAdapterRequest), responses=_TEXT, response_class=PlainTextResponse)
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    req = await parse_body(request, protocol.LoadLoraAdapterRequest)
    service = service_of(request)
    if req.lora_name == (await service.tokenizer_info()).model_name:
        raise InvalidRequest(f"{req.lora_name!r} is the base model's name", param="lora_name")
    await service.lora_control.load(req.lora_name, req.lora_path, req.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=request_body(
    protocol.UnloadLoraAdapterRequest), responses=_TEXT, response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    req = await parse_body(request, protocol.UnloadLoraAdapterRequest)
    await service_of(request).lora_control.unload(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
