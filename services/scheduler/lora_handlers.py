"""The scheduler's LoRA endpoints on the bus: an adapter loaded or unloaded at run time
(the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter reach every replica
here). The registry (lora_registry.py) is the service's, kept across worker re-attaches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from services.scheduler.lora_registry import LoraRegistry
from shared.bus import Bus
from shared.errors import InvalidRequest
from shared.lora_adapters import BaseShapes
from shared.messages import LoraLoadRequest, LoraReply, LoraUnloadRequest
from shared.subjects import Subjects

log = structlog.get_logger()


class LoraHandlers:
    def __init__(self, registry: LoraRegistry, base_shapes: Callable[[], BaseShapes | None],
                 changed: Callable[[], None]) -> None:
        """``base_shapes``: what the attached worker says adapters must fit (None: no
        worker, or one without LoRA); ``changed``: called after each change (stats go
        out at once)."""
        self.registry, self.base_shapes, self.changed = registry, base_shapes, changed

    async def serve(self, bus: Bus, subjects: Subjects, scheduler_id: str) -> None:
        """Answer this scheduler's load and unload requests on the bus."""
        for verb, message, handler in (("lora_load", LoraLoadRequest, self.load),
                                       ("lora_unload", LoraUnloadRequest, self.unload)):
            await bus.serve(subjects.scheduler_lora(scheduler_id, verb), message, handler)

    async def load(self, request: LoraLoadRequest) -> LoraReply:
        """Check the adapter's files whole (off the event loop: a header read and a hash
        of its bytes), then register it; InvalidRequest names what is wrong."""
        registry = self.registry
        ref = await asyncio.to_thread(registry.check_load, request.lora_name,
                                      request.lora_path, request.replace, self.base_shapes())
        if request.lora_name in registry.adapters and not request.replace:  # a racing load
            raise InvalidRequest(f"LoRA adapter {request.lora_name!r} is registered already "
                                 "(set load_inplace to replace it)", param="lora_name")
        replaced = registry.adapters.get(ref.name)
        registry.add(ref)
        log.info("lora_adapter_loaded", lora_name=ref.name, path=ref.path, rank=ref.rank,
                 content_hash=ref.content_hash,
                 replaced=replaced.content_hash if replaced else None)
        self.changed()
        return self.reply()

    async def unload(self, request: LoraUnloadRequest) -> LoraReply:
        self.registry.remove(request.lora_name)  # (NotFound when not registered)
        log.info("lora_adapter_unloaded", lora_name=request.lora_name)
        self.changed()
        return self.reply()

    def reply(self) -> LoraReply:
        return LoraReply(adapters=self.registry.refs(), timestamp=time.time())
