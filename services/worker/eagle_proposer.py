"""The worker's proposer for EAGLE heads (issue 52, methods ``eagle3`` and ``eagle``): the
draft model's passes (draft_model.py) with an EAGLE head (eagle_head.py) in the draft
model's place, fed the served model's own hidden states.

Positions. The head's KV at position i is computed from the target's feature at i
(hidden_capture.py: written into the feature cache by the target's forward at i) and the
token at i + 1; its output there predicts token i + 2. So for a request of n known tokens a
step's first pass computes positions [num_draft_computed, n - 1) (steady state: the 1 to
K + 1 tokens the last verify step kept, whose features that step's forward wrote), and its
last row's argmax is draft 1 (token n). Passes 2..K run one token a row at positions n - 1,
n, ..., each fed the pass before's output feature and draft: the chain EAGLE drafts. Those
positions' KV came from the head's own features, so only the positions before n - 1 count
as computed: the next step recomputes the kept ones from the target's features.

A request new to drafts (or back after a pause) catches up over its whole context first, in
forwards of at most ``max_num_tokens`` tokens, like the draft model. Features of positions
computed by another request's forward (prefix-cache hits) are in the cache already; blocks
a kvstore load filled have stale features, which can only make drafts worse, never the
output: the served model verifies every draft.
"""

from __future__ import annotations

import structlog
import torch

from services.worker.draft_model import DraftModel
from services.worker.eagle_head import EagleHead, load_eagle_head, read_eagle_spec
from services.worker.hidden_capture import FeatureCapture
from services.worker.model import AttentionMetadata, Transformer
from services.worker.staging import HostStaging
from services.worker.step_inputs import SequenceChunk, build_step_inputs
from shared.sections.speculative import SpeculativeConfig

log = structlog.get_logger()


class EagleProposer(DraftModel):
    """Fills every draft slot of a step from the head, right before the step's forward."""

    token_shift = 1

    def __init__(self, head: EagleHead, name: str, kv_cache: torch.Tensor,
                 capture: FeatureCapture, block_size: int, max_num_tokens: int,
                 staging: HostStaging | None) -> None:
        super().__init__(head, name, kv_cache, block_size, max_num_tokens, staging)
        self.capture = capture
        self._features: torch.Tensor | None = None  # [rows, hidden]: the last pass's outputs

    def _computed_after(self, num_known: int, num_slots: int) -> int:
        return num_known - 1  # (the later positions hold KV of the head's own features)

    def _draft_ids(self, logits: torch.Tensor) -> torch.Tensor:
        return self.model.draft_ids(logits)

    def _first_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata: AttentionMetadata) -> torch.Tensor:
        """The target's features of these positions in; the last rows' output features kept
        for pass 2."""
        head: EagleHead = self.model
        head.feature_buffer[:len(input_ids)].copy_(self.capture.gather(metadata.slot_mapping))
        logits = head(input_ids, positions, metadata)
        self._features = head.hidden_out[metadata.logits_indices]  # [num_rows, hidden]
        return logits

    def _run_pieces(self, pieces: list[SequenceChunk]) -> None:
        input_ids, positions, metadata = build_step_inputs(
            pieces, self.block_size, self.device, staging=self.staging)
        self.model.feature_buffer[:len(input_ids)].copy_(
            self.capture.gather(metadata.slot_mapping))
        self.model(input_ids, positions, metadata)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """Passes 2..K: the rows' previous output features in (rows are a prefix of the
        pass before's)."""
        count = len(input_ids)
        head: EagleHead = self.model
        head.feature_buffer[:count].copy_(self._features[:count])
        logits = super()._forward(input_ids, positions, metadata)
        self._features = head.hidden_out
        return logits


def load_eagle(spec_config: SpeculativeConfig, target: Transformer, cache_dir: str,
               max_rows: int, device: torch.device, dtype: torch.dtype
               ) -> tuple[EagleHead, torch.Tensor | None]:
    """The head, checked against the served model first (refused at start, the field named,
    when it does not fit), and EAGLE-3's fc (eagle_head.load_eagle_head). ``max_rows``: the
    most tokens one head forward takes."""
    from shared.models import resolve_eagle_head

    path = resolve_eagle_head(spec_config.model, cache_dir)
    spec = read_eagle_spec(path, spec_config.method, target.config)
    head, fc = load_eagle_head(path, spec, target, max_rows, device, dtype)
    log.info("eagle_head_loaded", method=spec.method, head=str(path),
             draft_vocab_size=spec.config.vocab_size, aux_layer_ids=list(spec.aux_layer_ids))
    return head, fc


def build_eagle_proposer(name: str, head: EagleHead, fc: torch.Tensor | None,
                         target: Transformer, kv_cache: torch.Tensor, block_size: int,
                         max_num_tokens: int, staging: HostStaging | None) -> EagleProposer:
    """Install the feature capture in the target's forward (before its graphs are captured)
    and the proposer over both; ``kv_cache``: the head's [1, 2, num_blocks, ...] cache."""
    num_blocks = kv_cache.shape[2]
    capture = FeatureCapture(num_blocks * block_size, target.config.hidden_size,
                             head.feature_buffer.dtype, kv_cache.device,
                             head.spec.aux_layer_ids, fc)
    target.hidden_capture = capture
    return EagleProposer(head, name, kv_cache, capture, block_size, max_num_tokens, staging)
