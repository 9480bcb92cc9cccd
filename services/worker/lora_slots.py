"""LoRA in the step: adapters placed in device slots, and each step's segments handed to the
projections that add their deltas.

Design. Every LoRA-targeted projection of the model (each layer's ``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``: layers.py ``Linear``) gets a ``LinearLora``: its slots
(``a`` [max_loras, parts * max_rank, in_features], ``b`` [max_loras, out_features,
parts * max_rank]) and a reference to one ``LoraBatch``, a holder all of them share. The
runner sets the holder's ``step`` (a ``LoraStep``: (slot, first row, end row) segments of the
step's flattened tokens, made on the host from its chunks) before the forward and clears it
after; a projection adds ``x[rows] @ a[slot]^T @ b[slot]^T`` for each segment. No module
global: the holder is an object the model's modules were handed when LoRA was enabled, and a
model without LoRA has no ``LinearLora`` at all (``Linear.lora`` is None: not one extra op).

A fused projection's parts are blocks of its slot: part p's A in rows [p*max_rank,
p*max_rank + r) of ``a``, its B in ``b``'s rows of p (q, then k, then v; gate, then up) and
columns [p*max_rank, p*max_rank + r); everything else is exact zeros, so a smaller rank or an
untargeted part adds exactly nothing. The scaling is folded into B.

On CUDA the deltas are kernels/lora.py's shrink and expand over the step's adapter rows
grouped by slot (handed to the ops as a kernels/lora_delta.py ``LoraDelta``: at decode sizes
the shrink may run inside the projection's own GEMM launch, gate_up's SwiGLU inside its
expand's): the runner's ``begin`` writes them (``lora_rows``,
that module's layout) into one static device buffer the holder keeps, so a CUDA graph
captured with LoRA active (``capturing``: cuda_graphs.py keeps a second set of graphs) serves
any step with adapter rows; a step without any runs the graphs captured without LoRA, the
same kernels as with LoRA off. On the CPU (and with ``lora_rows`` None) the segments above
with torch ops, the reference.

Slots are filled on the device's stream, ordered after the kernels (or graph replays) of a
step still in flight that read the slot's old adapter; so is the copy into ``lora_rows``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from kernels.lora import group_rows
from kernels.lora_delta import LoraDelta
from kernels.lora_configs import LoraPlan, plan_for

from services.worker.lora import (
    FUSED_PARTS, LoraAdapter, base_shapes, load_adapter, part_shapes, shard_part,
)
from shared.lora_adapters import content_hash
from services.worker.model_config import ModelConfig

if TYPE_CHECKING:  # (step_inputs imports the model, whose layers import this module)
    from services.worker.staging import HostStaging
    from services.worker.step_inputs import SequenceChunk
    from services.worker.step_state import RequestState

log = structlog.get_logger()


@dataclass(frozen=True)
class LoraStep:
    # (slot, first row, end row) over the step's tokens, ascending, rows of one slot merged
    segments: tuple[tuple[int, int, int], ...]


class LoraBatch:
    """The holder the model's ``LinearLora``s share. ``active``: the step in progress has
    adapter rows (or a capture holds the deltas); ``step``: its segments (None between steps
    and in steps without adapter rows); ``lora_rows``: CUDA, the static buffer [1 + 2 *
    max_num_tokens] int32 the kernels read (None: the segments' torch ops)."""

    def __init__(self, lora_rows: torch.Tensor | None = None) -> None:
        self.step: LoraStep | None = None
        self.lora_rows = lora_rows
        self.active = False


class LinearLora:
    """One projection's device slots; ``add`` puts the step's deltas into its output."""

    def __init__(self, batch: LoraBatch, part_sizes: tuple[int, ...], in_features: int,
                 max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.batch, self.part_sizes, self.max_rank = batch, part_sizes, max_rank
        width = len(part_sizes) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(max_loras, sum(part_sizes), width, device=device, dtype=dtype)

    @property
    def active(self) -> bool:
        """The step in progress has adapter rows."""
        return self.batch.active

    @property
    def kernels(self) -> bool:
        """The deltas come from kernels/lora.py, added into any tensor of out's shape (a
        fused op's residual may take them); else the segments' torch ops."""
        return self.batch.lora_rows is not None

    def delta(self, x: torch.Tensor) -> LoraDelta | None:
        """The kernels' deltas of x [num_tokens, in_features] in this step (the projection's
        op adds them: kernels/lora.py's shrink inside the skinny GEMM's launch, or its two
        launches after the base GEMM); None without adapter rows or on the torch path."""
        lora_rows = self.batch.lora_rows
        if not self.batch.active or lora_rows is None:
            return None
        return LoraDelta(self.a, self.b, lora_rows, self._plan(x))

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features], out [num_tokens, out_features]: out plus each
        adapter row's delta (in place); out unchanged without a LoRA step."""
        if not self.batch.active:
            return out
        delta = self.delta(x)
        if delta is not None:  # (after the base GEMM: the shrink before it was 0.16 ms/token
            return delta.add(x, out)  # slower at batch 1 on an H200)
        for slot, start, end in self.batch.step.segments:
            shrunk = x[start:end] @ self.a[slot].T  # [rows, parts * max_rank]
            out[start:end] += shrunk @ self.b[slot].T  # [rows, out_features]
        return out

    def _plan(self, x: torch.Tensor) -> LoraPlan:
        return plan_for(x.shape[1], self.a.shape[1], self.b.shape[1], x.shape[0], x.dtype)

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
              scaling: float) -> None:
        """Slot ``slot`` holds ``parts`` (per part (A [r, in], B [out, r]) or None: none)."""
        a = torch.zeros(self.a.shape[1:])  # [parts * max_rank, in_features] fp32, host
        b = torch.zeros(self.b.shape[1:])  # [out_features, parts * max_rank]
        row = 0
        for index, (size, pair) in enumerate(zip(self.part_sizes, parts, strict=True)):
            if pair is not None:
                lora_a, lora_b = pair
                col, rank = index * self.max_rank, lora_a.shape[0]
                a[col:col + rank] = lora_a
                b[row:row + size, col:col + rank] = lora_b * scaling
            row += size
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)


class NoLora:
    """The null seam: LoRA off. A request naming an adapter is refused; no step has rows."""

    active = False

    base_shapes = None  # (announced: the worker computes no adapter)
    graph_capture = None  # (no graphs with LoRA deltas)

    def resolve(self, request_id: str, lora_name: str, lora_path: str = "",
                lora_hash: str = "") -> str:
        if lora_name:
            raise ValueError(f"request {request_id}: lora_name {lora_name!r} but LoRA is not "
                             f"enabled (--enable-lora)")
        return ""

    def begin(self, states: Sequence[RequestState], chunks: Sequence[SequenceChunk],
              running: Iterable[RequestState]) -> None:
        pass

    def forget(self, cache_keys: Iterable[str]) -> None:
        pass

    def end(self) -> None:
        pass


def attach_linear_loras(model: torch.nn.Module, batch: LoraBatch, max_loras: int,
                        max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
    """Give each targeted projection of ``model`` (a Transformer) its slots; a sparse
    (MoE) layer's MLP gets none."""
    shapes = part_shapes(model.config)
    for layer in model.layers:
        for fused, linear in _layer_linears(layer):
            parts = FUSED_PARTS[fused]
            linear.lora = LinearLora(batch, tuple(shapes[p][0] for p in parts),
                                     shapes[parts[0]][1], max_loras, max_rank, device, dtype)


class LoraSlots:
    """The runner's LoRA seam when enabled: registered adapters, those kept in host memory
    (LRU, ``max_cpu_loras``), the device slots' tenants (LRU among adapters no request in
    the step uses, preferring ones no running request uses), and each step's segments."""

    def __init__(self, model: torch.nn.Module, modules: list[tuple[str, str]], max_loras: int,
                 max_rank: int, max_cpu_loras: int, device: torch.device, dtype: torch.dtype,
                 max_num_tokens: int = 0, staging: HostStaging | None = None):
        """``max_num_tokens``: the most tokens a step has (CUDA: the kernels' row buffer);
        ``staging``: the runner's pinned buffers, which that buffer is copied in through."""
        # the whole model's (adapters are checked and split by it); slots are this rank's
        self.config: ModelConfig = model.whole_config
        self.tp = model.tp
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.max_num_tokens, self.staging, self.device = max_num_tokens, staging, device
        self.batch = LoraBatch(torch.zeros(1 + 2 * max_num_tokens, dtype=torch.int32,
                                           device=device) if device.type == "cuda" else None)
        attach_linear_loras(model, self.batch, max_loras, max_rank, device, dtype)
        self.layers = list(model.layers)
        self.paths: dict[str, str] = {}  # registered key -> directory
        self.hashes: dict[str, str] = {}  # registered key -> content hash at registration
        self.base_shapes = base_shapes(self.config, max_rank)  # (announced to the scheduler)
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # oldest use first
        self.tenants: list[str | None] = [None] * max_loras  # slot -> adapter name
        self.last_use = [0] * max_loras
        self.clock = 0
        for name, path in modules:
            self.register(name, path)

    @property
    def active(self) -> bool:
        return self.batch.active

    @property
    def graph_capture(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        """What a CUDA graph holding the deltas is captured under (None: the torch path,
        which runs such steps eagerly)."""
        return None if self.batch.lora_rows is None else self.capturing

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """LoRA active over no adapter rows (the kernels launch and add nothing): the graphs
        captured inside replay any step's rows from ``lora_rows``."""
        self.batch.lora_rows[:1].zero_()
        self.batch.active = True
        try:
            yield
        finally:
            self.batch.active = False

    def register(self, name: str, path: str) -> LoraAdapter:
        """Load and check adapter ``name``; a ValueError names what is wrong."""
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is registered already")
        adapter = load_adapter(name, path, self.config, self.max_rank)
        self.paths[name], self.hashes[name] = path, content_hash(path)
        self._keep_on_host(adapter)
        log.info("lora_adapter_registered", lora_name=name, path=str(path), rank=adapter.rank,
                 target_modules=list(adapter.target_modules))
        return adapter

    def resolve(self, request_id: str, lora_name: str, lora_path: str = "",
                lora_hash: str = "") -> str:
        """The key a request's adapter is registered under ("": the base model). With a
        ``lora_path`` (the scheduler's registry: loaded at run time, or reloaded with new
        files) one not registered yet is registered now, under its name and hash, so two
        versions of a name never share a slot; a ValueError names what is wrong."""
        if not lora_name or (lora_name in self.paths and
                             lora_hash in ("", self.hashes[lora_name])):
            return self._known(request_id, lora_name)
        key = f"{lora_name}#{lora_hash}"
        if key not in self.paths:
            if not lora_path:
                return self._known(request_id, lora_name)
            self.register(key, lora_path)
        return key

    def _known(self, request_id: str, lora_name: str) -> str:
        if lora_name and lora_name not in self.paths:
            raise ValueError(f"request {request_id}: unknown LoRA adapter {lora_name!r} "
                             f"(registered: {', '.join(sorted(self.paths)) or 'none'})")
        return lora_name

    def forget(self, cache_keys: Iterable[str]) -> None:
        """Drop the versions the scheduler retired (``LoraRef.cache_key``: unloaded or
        replaced, no request uses them): their registration, host copy and slot."""
        for cache_key in cache_keys:
            name, _, content = cache_key.rpartition(":")
            key = name if self.hashes.get(name) == content else f"{name}#{content}"
            if self.paths.pop(key, None) is None:
                continue  # never used here
            del self.hashes[key]
            self.host.pop(key, None)
            if key in self.tenants:  # (its weights stay until the slot's next tenant)
                self.tenants[self.tenants.index(key)] = None
            log.info("lora_adapter_forgotten", lora_name=name, key=key)

    def begin(self, states: Sequence[RequestState], chunks: Sequence[SequenceChunk],
              running: Iterable[RequestState]) -> None:
        """Before a step's forward: its chunks' (and their requests' ``states``') segments,
        their adapters placed in slots first. ``running``: every running request's state."""
        self.set_step([state.lora_name for state in states],
                      [len(chunk.token_ids) for chunk in chunks],
                      lambda: {state.lora_name for state in running})

    def set_step(self, names: list[str], num_rows: list[int],
                 running: Callable[[], set[str]] = set) -> None:
        """The step's segments from its chunks' adapter names ("" base) and row counts;
        ``running()``: the adapters running requests use (asked only to evict)."""
        wanted = set(names) - {""}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters, more than max_loras "
                             f"{self.max_loras}")
        slot_of = {name: self._ensure_slot(name, wanted, running) for name in wanted}
        segments: list[tuple[int, int, int]] = []
        start = 0
        for name, rows in zip(names, num_rows, strict=True):
            if name:
                slot = slot_of[name]
                if segments and segments[-1][0] == slot and segments[-1][2] == start:
                    segments[-1] = (slot, segments[-1][1], start + rows)
                else:
                    segments.append((slot, start, start + rows))
            start += rows
        self.batch.step = LoraStep(tuple(segments)) if segments else None
        self.batch.active = bool(segments)
        if segments and self.batch.lora_rows is not None:
            self._copy_rows(segments, start)

    def _copy_rows(self, segments: list[tuple[int, int, int]], num_tokens: int) -> None:
        """The step's rows grouped by slot into ``lora_rows``, on the step's stream (after
        the kernels of a step in flight that read it)."""
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"a LoRA step of {num_tokens} tokens, more than max_num_tokens "
                             f"{self.max_num_tokens}")
        token_slots = np.full(num_tokens, -1, np.int32)  # [num_tokens]
        for slot, first, end in segments:
            token_slots[first:end] = slot
        grouped = group_rows(token_slots)  # [1 + 2 * num adapter rows]
        if self.staging is not None:
            source = self.staging.to_device([grouped], np.int32)[0]
        else:
            source = torch.from_numpy(grouped).to(self.device)
        self.batch.lora_rows[:len(grouped)].copy_(source)

    def end(self) -> None:
        self.batch.step = None
        self.batch.active = False

    def _ensure_slot(self, name: str, wanted: set[str], running: Callable[[], set[str]]
                     ) -> int:
        """The slot holding ``name``, placing it first where it is not resident."""
        self.clock += 1
        if name in self.tenants:
            slot = self.tenants.index(name)
        else:
            slot = self._free_slot(wanted, running)
            self._place(slot, self._host_adapter(name))
        self.last_use[slot] = self.clock
        return slot

    def _free_slot(self, wanted: set[str], running: Callable[[], set[str]]) -> int:
        if None in self.tenants:
            return self.tenants.index(None)
        running = running()
        # not this step's adapters; those no running request uses first, then the oldest use
        candidates = [s for s, tenant in enumerate(self.tenants) if tenant not in wanted]
        return min(candidates, key=lambda s: (self.tenants[s] in running, self.last_use[s]))

    def _place(self, slot: int, adapter: LoraAdapter) -> None:
        for index, layer in enumerate(self.layers):
            for fused, linear in _layer_linears(layer):
                linear.lora.write(slot, [self._rank_part(adapter, index, part)
                                         for part in FUSED_PARTS[fused]], adapter.scaling)
        log.debug("lora_slot_filled", lora_name=adapter.name, slot=slot,
                  evicted=self.tenants[slot])
        self.tenants[slot] = adapter.name

    def _rank_part(self, adapter: LoraAdapter, layer: int, part: str
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        pair = adapter.part(layer, part)
        return None if pair is None else shard_part(part, *pair, self.config, self.tp)

    def _host_adapter(self, name: str) -> LoraAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # dropped from host memory (max_cpu_loras): read it again
            adapter = load_adapter(name, self.paths[name], self.config, self.max_rank)
            self._keep_on_host(adapter)
        self.host.move_to_end(name)
        return adapter

    def _keep_on_host(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        while self.max_cpu_loras and len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)


def _layer_linears(layer: torch.nn.Module):
    """(fused name, Linear) of a decoder layer's projections that have slots."""
    pairs = [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]
    if not layer.sparse:
        pairs += [("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]
    return pairs
