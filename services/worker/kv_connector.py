"""The worker's side of the kvstore seam (docs/kvstore.md): a step's work with the kvstore,
one hook per phase of the runner's step (vLLM's worker-side KV connector is the model of
the split, not of the code):

- ``prepare(plan)``: the loads this worker cannot make become recomputes;
- ``before_forward(...)``: start the plan's loads, copy out its stores of blocks full
  already (before this step may write their ids again), and order the forward after the
  copies still reading blocks it writes and the loads still writing blocks it touches;
- ``after_forward(step)``: copy out the blocks this step completes, behind its forward;
- ``end_submit()``: every token of a submit's stores is on the host: read them, and
  commit the copies that have finished.

On CUDA a plan's loads run on a load stream beside its forward; a step touching blocks
still loading (e.g. the loading request's own first chunk) waits for them on the device;
a step's result is read back only once its loads are complete (``KvStep.loads_done``),
since the scheduler then lets the requests that only loaded in it compute.

``NoKvConnector`` is the runner's default (``--no-kvstore``, or no kvstore attached yet):
it turns every load into a recompute and does nothing else. ``KvConnector`` works with an
attached ``KvOffload`` (kv_offload.py), which the worker service's upkeep (kv_upkeep.py)
attaches, keeps reserved and replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import torch

from services.worker.cuda_copy import check_memcpy_2d
from services.worker.kv_offload import BlocksToStore, KvOffload, recompute_unusable_loads
from services.worker.kv_step import NO_KV_WORK, KvStep, LayerWaits
from services.worker.kv_tiers import LoadTiming
from shared.messages import StepPlan

if TYPE_CHECKING:
    from services.worker.config import WorkerConfig
    from services.worker.step_inputs import SequenceChunk
    from services.worker.step_state import RequestState

log = structlog.get_logger()


class NoKvConnector:
    """No kvstore: a plan's loads are computed instead, nothing is stored."""

    offload: KvOffload | None = None

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, plan: StepPlan) -> StepPlan:
        """``plan`` as the runner runs it: loads it cannot make turned into recomputes."""
        return recompute_unusable_loads(plan, None, self.block_size)[0]

    def before_forward(self, plan: StepPlan, chunks: list[SequenceChunk],
                       requests: dict[str, RequestState],
                       finished: dict[str, RequestState]) -> KvStep:
        """``requests``: the runner's, after this plan's arrivals; ``finished``: those this
        plan finished (their stores may still be in it)."""
        return NO_KV_WORK

    def after_forward(self, step: KvStep) -> None:
        pass

    def end_submit(self) -> None:
        pass

    def close(self) -> None:
        pass


class KvConnector(NoKvConnector):
    """A kvstore attached: ``offload``'s loads, stores and commits around each step."""

    def __init__(self, offload: KvOffload, block_size: int,
                 waits_between_layers: Callable[[list[SequenceChunk]], bool],
                 forget_loaded_blocks: Callable[[list[int]], None]) -> None:
        super().__init__(block_size)
        self.offload = offload
        # the forward of these chunks can wait between its layers (not a decode graph)
        self._waits_between_layers = waits_between_layers
        # blocks written from outside the model: the model forgets what it holds of them
        self._forget_loaded_blocks = forget_loaded_blocks

    def prepare(self, plan: StepPlan) -> StepPlan:
        plan, num_recomputed = recompute_unusable_loads(plan, self.offload, self.block_size)
        if num_recomputed:
            self.offload.num_recomputed += num_recomputed
        return plan

    def before_forward(self, plan: StepPlan, chunks: list[SequenceChunk],
                       requests: dict[str, RequestState],
                       finished: dict[str, RequestState]) -> KvStep:
        tiers = self.offload.tiers
        read: list[list[int]] = []
        by_layer = False
        if plan.kv_loads or tiers.pending_loads:  # (steps without loads skip this)
            # per chunk, the blocks it reads (its context, its new tokens' blocks included)
            read = [chunk.block_table[:(chunk.start + len(chunk.token_ids) - 1)
                                      // self.block_size + 1] for chunk in chunks]
            by_layer = bool(chunks) and self._waits_between_layers(chunks)
        load = self._start_loads(plan, read, by_layer) if plan.kv_loads else None
        stores: list[BlocksToStore] = []
        if plan.kv_stores:
            stores = self.offload.resolve_stores(
                plan.kv_stores, _store_lookup(plan, chunks, requests, finished))
            self.offload.store([run for run in stores if run.computed_before])
        layer_waits = self._order_forward(chunks, read, by_layer)
        return KvStep(load, [run for run in stores if not run.computed_before], layer_waits)

    def _start_loads(self, plan: StepPlan, read: list[list[int]], by_layer: bool
                     ) -> LoadTiming:
        # Layer groups pay only when this step's forward reads the blocks (it then runs its
        # first layers under the copy of the later ones); a load read by a later step goes
        # in one group: G times fewer copies to issue (random slots: one per block).
        loaded = {block_id for load in plan.kv_loads for block_id in load.block_ids}
        read_now = by_layer and any(not loaded.isdisjoint(ids) for ids in read)
        timing = self.offload.load(plan.kv_loads, in_layer_groups=read_now)
        self._forget_loaded_blocks([block_id for load in plan.kv_loads
                                    for block_id in load.block_ids])
        return timing

    def _order_forward(self, chunks: list[SequenceChunk], read: list[list[int]],
                       by_layer: bool) -> LayerWaits:
        """The forward waits (on the device) for the store copies still reading blocks it
        writes, and for the loads still writing blocks it touches: whole, or per layer."""
        tiers = self.offload.tiers
        if not (tiers.has_pending or tiers.pending_loads):
            return None
        block_size = self.block_size
        written = [block_id for chunk in chunks for block_id in chunk.block_table[
            chunk.start // block_size:(chunk.start + len(chunk.token_ids) - 1) // block_size + 1]]
        if tiers.has_pending:
            tiers.wait_for_stores(written)
        if not tiers.pending_loads:  # blocks still loading that this step reads or writes
            return None
        return tiers.wait_for_loads((block_id for ids in read for block_id in ids), written,
                                    by_layer=by_layer)

    def after_forward(self, step: KvStep) -> None:
        if step.late_stores:  # the blocks this step completes, copied out behind it
            self.offload.store(step.late_stores)

    def end_submit(self) -> None:
        self.offload.end_submit()  # every token its stores hold is on the host now

    def close(self) -> None:
        """Finish its copies and unmap the arena; its commits are dropped."""
        self.offload.close()


def _store_lookup(plan: StepPlan, chunks: list[SequenceChunk],
                  requests: dict[str, RequestState], finished: dict[str, RequestState]
                  ) -> Callable[[str], tuple[list[int], list[int], int, int] | None]:
    """What ``KvOffload.resolve_stores`` asks of a request: (token list, block table after
    this step, computed tokens before this step, after it), None when unknown."""
    scheduled = {s.request_id: (s, chunk) for s, chunk in zip(plan.scheduled, chunks)}

    def lookup(request_id: str) -> tuple[list[int], list[int], int, int] | None:
        state = requests.get(request_id) or finished.get(request_id)
        if state is None:
            return None
        entry = scheduled.get(request_id) if requests.get(request_id) is state else None
        if entry is None:
            return (state.token_ids, state.block_table, state.num_computed_tokens,
                    state.num_computed_tokens)
        return (state.token_ids, entry[1].block_table, state.num_computed_tokens,
                state.num_computed_tokens + entry[0].num_new_tokens)
    return lookup


def usable_load_groups(config: WorkerConfig, num_layers: int, device: torch.device) -> int:
    """The layer groups this worker's loads copy in: the flag's, at most one a layer; 1 on
    CPU (a load is a plain copy there), without a kvstore, or where ``cudaMemcpy2DAsync``
    cannot be bound or copies wrong (checked now, at start, not in a step)."""
    num_groups = min(config.kv_load_layer_groups, num_layers)
    if device.type != "cuda" or not config.kv_node_id or num_groups == 1:
        return 1
    try:
        check_memcpy_2d(device)
    except RuntimeError as exc:
        log.warning("kv_load_layer_groups_unavailable", num_groups=num_groups, error=str(exc),
                    detail="loads copy all their layers at once")
        return 1
    return num_groups
