"""A stand-in for GatewayService with what the HTTP app uses of it, and canned answers:
one model, a tokenizer that makes one token per word, and every sequence answering with
the deltas it is given. It records what the app submitted and released, so a test can
check the app's side of the interface without NATS, a tokenizer or a scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.metrics import GatewayMetrics
from services.gateway.streams import Delta, RequestStream
from shared.errors import FlotillaError
from shared.messages import (EncodeReply, EncodeRequest, SamplingParams, TokenizerInfo,
                             choice_request_ids)

MODEL = "fake-model"
MAX_MODEL_LEN = 64


@dataclass
class Submitted:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    n: int
    session: str | None


@dataclass
class FakeService:
    answer: list[Delta] = field(default_factory=lambda: [
        Delta("Hello", 1), Delta(" world", 1, "length")])
    refuse: FlotillaError | None = None  # raised by submit once `accept` were taken
    accept: int = 0
    replica_ready: bool = True
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    submitted: list[Submitted] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    started: bool = False
    stopped: bool = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo(model_name=MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=1000,
                             eos_token_ids=[0], has_chat_template=True)

    async def encode(self, request: EncodeRequest) -> list[int]:
        text = request.prompt if request.prompt is not None else \
            " ".join(message.content or "" for message in request.messages)
        return [len(word) for word in text.split()]  # one token per word

    async def encode_reply(self, request: EncodeRequest) -> EncodeReply:
        return EncodeReply(token_ids=await self.encode(request))

    async def decode(self, token_ids: list[int]) -> str:
        return " ".join("x" * token_id for token_id in token_ids)

    async def health(self) -> dict[str, dict]:
        return {name: {"status": "ok"} for name in ("tokenizer", "scheduler", "worker")}

    def replica_readiness(self) -> dict[str, dict]:
        return {"0": {"scheduler_id": "s0", "ready": self.replica_ready}}

    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     stop: list[str], *, priority: int = 0, cache_salt: str | None = None,
                     n: int = 1, session: str | None = None, lora_name: str = "",
                     images: list | None = None) -> tuple[str, list[RequestStream]]:
        if self.refuse is not None and len(self.submitted) >= self.accept:
            raise self.refuse
        request_id = f"r{len(self.submitted)}"
        self.submitted.append(Submitted(prompt_token_ids, sampling, stop, n, session))
        return request_id, [RequestStream(choice_id, detokenizer=None)
                            for choice_id in choice_request_ids(request_id, n)]

    def lora_adapters(self) -> dict:
        return {}  # (no LoRA adapters)

    def lora_ref(self, lora_name: str):
        return None

    async def deltas(self, stream: RequestStream):
        for delta in self.answer:
            yield delta

    def release(self, stream: RequestStream) -> None:
        self.released.append(stream.request_id)
