"""The tokenizer's NATS edge. Stateless: any replica answers any call."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.encoding import TextCodec
from shared.bus import Bus
from shared.messages import (
    DecodeReply, DecodeRequest, Empty, EncodeReply,
    EncodeRequest, HealthReply, TokenizerInfo,
)
from shared.models import resolve_model
from shared.runtime import freeze_startup_objects, log_startup
from shared.subjects import Subjects

log = structlog.get_logger()


class TokenizerService:
    def __init__(self, config: TokenizerConfig, bus: Bus, codec: TextCodec, model_name: str) -> None:
        self.config = config
        self.bus = bus
        self.codec = codec
        self.info = codec.info(model_name)
        self.subjects = Subjects(config.namespace)
        # images are decoded, resized, tiled and normalized here, off the event loop
        self._image_pool = ThreadPoolExecutor(config.image_workers,
                                              thread_name_prefix="image")

    async def start(self) -> None:
        s = self.subjects
        queue = s.queue_group("tokenizer")
        # concurrent: a request with images waits for the image pool, not for the requests
        # before it (text ones are answered at once, beside it)
        await self.bus.serve(s.tokenizer_encode, EncodeRequest, self._on_encode, queue=queue,
                             concurrent=True)
        await self.bus.serve(s.tokenizer_decode, DecodeRequest, self._on_decode, queue=queue)
        await self.bus.serve(s.tokenizer_info, Empty, self._on_info, queue=queue)
        await self.bus.serve(s.health("tokenizer"), Empty, self._on_health, queue=queue)

    async def _on_encode(self, request: EncodeRequest) -> EncodeReply:
        if not request.images:
            return EncodeReply(token_ids=self.codec.encode(request))
        token_ids, images = await asyncio.get_running_loop().run_in_executor(
            self._image_pool, self.codec.encode_with_images, request)
        log.debug("images_preprocessed", num_images=len(images),
                  num_tiles=sum(image.pixel_shape[0] for image in images))
        return EncodeReply(token_ids=token_ids, images=images)

    async def _on_decode(self, request: DecodeRequest) -> DecodeReply:
        return DecodeReply(text=self.codec.decode(request))

    async def _on_info(self, _: Empty) -> TokenizerInfo:
        return self.info

    async def _on_health(self, _: Empty) -> HealthReply:
        return HealthReply(service="tokenizer", instance_id=self.config.instance_id,
                           detail={"model": self.info.model_name})


async def serve(config: TokenizerConfig, stop: asyncio.Event) -> None:
    model_files = resolve_model(config.model, config.cache_dir)
    codec = await asyncio.to_thread(TextCodec, model_files.path, config.max_model_len,
                                    config.max_image_pixels, config.cache_dir)
    log_startup("tokenizer_loaded")
    bus = await Bus.connect(config.nats_url, name=f"tokenizer-{config.instance_id}",
                            on_lost=stop.set)
    # The gateway learns the API's model name from here (TokenizerInfo); the engine keeps
    # keying its caches on the model's own name.
    service = TokenizerService(config, bus, codec, config.served_model_name or model_files.name)
    await service.start()
    freeze_startup_objects()
    log.info("tokenizer_started", model=model_files.name)
    log_startup("serving")
    try:
        await stop.wait()
    finally:
        await bus.close()
    bus.exit_if_lost()  # NATS closed the connection for good: exit non-zero, to be restarted
