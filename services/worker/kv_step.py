"""What a step's kvstore work leaves for the rest of the step (kv_connector.py makes it; the
step in flight, step_state.py, holds it until its result is read back)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.kv_offload import BlocksToStore
from services.worker.kv_tiers import LoadTiming

# per layer, the load events its attention waits for (None: none)
LayerWaits = list[list[torch.cuda.Event]] | None


@dataclass(frozen=True)
class KvStep:
    """What a step's kvstore work leaves for the rest of the step: its loads' timing, the
    stores of blocks it completes (copied out after its forward), and per layer the load
    events its attention waits for (loads in layer groups, when the forward can wait
    between layers)."""

    load: LoadTiming | None = None
    late_stores: Sequence[BlocksToStore] = ()
    layer_waits: LayerWaits = None

    def loads_done(self) -> bool:
        end = self.load.end if self.load is not None else None
        return end is None or end.query()

    def wait_for_loads(self) -> None:
        if self.load is not None and self.load.end is not None:
            self.load.end.synchronize()

    @property
    def load_bytes(self) -> int:
        return self.load.num_bytes if self.load is not None else 0

    def load_bytes_per_s(self) -> float:
        return self.load.bytes_per_s() if self.load is not None else 0.0


NO_KV_WORK = KvStep()
