"""The served model's hidden states, kept for an EAGLE head (issue 52): the seam inside the
target's forward (``Transformer.hidden_capture``). ``NoCapture`` (every method but EAGLE's)
asks for no layer and writes nothing. ``FeatureCapture`` writes each token's *feature* into a
feature cache indexed like the KV cache, by the step's slot mapping:

- eagle3: fc(concat(h_low, h_mid, h_high)), the residual stream entering three layers, fused
  by the head's ``fc``, summed one layer's third of fc at a time as the forward passes them
  (no concatenated copy; the stream's tensor is updated in place by the next layer);
- eagle: the last hidden state after the final norm.

So the writes are device ops addressed by slot mapping, like the KV writes: a CUDA graph of a
decode or verify step (cuda_graphs.py) holds them, and padding rows (slot -1) go to one spare
row past the cache. A position's feature is what its draft KV is computed from at the next
step (eagle_proposer.py); positions cached by another request (prefix cache) have theirs.
"""

from __future__ import annotations

import torch


class NoCapture:
    """Nothing captured: the forward asks ``layer_ids`` (empty) and ``captures_final``."""

    layer_ids: frozenset[int] = frozenset()
    captures_final = False

    def take(self, layer_id: int, stream: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        pass

    def take_final(self, normed: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        pass


NO_CAPTURE = NoCapture()


class FeatureCapture:
    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, aux_layer_ids: tuple[int, ...] = (),
                 fc_weight: torch.Tensor | None = None) -> None:
        """``num_slots``: num_blocks * block_size; ``aux_layer_ids`` with ``fc_weight``
        [hidden, len(ids) * hidden] (eagle3), or neither (eagle: the final normed state)."""
        # [num_slots + 1, hidden]: the last row takes the padding rows' writes
        self.cache = torch.zeros(num_slots + 1, hidden_size, dtype=dtype, device=device)
        self.spare_row = num_slots
        self.layer_ids = frozenset(aux_layer_ids)
        self.captures_final = not aux_layer_ids
        self._first = min(aux_layer_ids) if aux_layer_ids else -1
        # layer id -> its third of fc [hidden, hidden] (a layer named twice: both summed)
        self._fc_parts: dict[int, torch.Tensor] = {}
        for i, layer_id in enumerate(aux_layer_ids if fc_weight is not None else ()):
            part = fc_weight[:, i * hidden_size:(i + 1) * hidden_size]
            self._fc_parts[layer_id] = (part + self._fc_parts[layer_id] if layer_id in
                                        self._fc_parts else part.contiguous())

    def rows(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The cache rows of a step's tokens [num_tokens] (padding: the spare row)."""
        return torch.where(slot_mapping < 0, self.spare_row, slot_mapping)

    def take(self, layer_id: int, stream: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``stream`` [num_tokens, hidden]: the residual stream entering ``layer_id``."""
        part = torch.nn.functional.linear(stream, self._fc_parts[layer_id])
        rows = self.rows(slot_mapping)
        if layer_id == self._first:
            self.cache.index_copy_(0, rows, part)
        else:
            self.cache.index_add_(0, rows, part)

    def take_final(self, normed: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.cache.index_copy_(0, self.rows(slot_mapping), normed)

    def gather(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The features of these slots [num_tokens, hidden]."""
        return self.cache.index_select(0, self.rows(slot_mapping))
