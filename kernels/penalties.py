"""Presence, frequency and repetition penalties in one pass over the logits (Triton + torch).

Per row ``r`` with table slot ``slot >= 0`` (rows with slot -1 are left alone), over every
token ``t``: ``count = output_counts[slot, t]``, ``seen = count > 0 or prompt_mask[slot, t]``;
a seen token's logit is divided by the row's repetition penalty when positive and multiplied
by it otherwise, then ``frequency * count + presence * (count > 0)`` is subtracted.
One launch for the batch, in place, no host sync: the per-step cost is one read of the
logits and of each row's tables, whatever the context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 1024


@triton.jit
def _penalties_kernel(
    logits_ptr, counts_ptr, prompt_mask_ptr, params_ptr, logits_stride_row, table_stride_row,
    num_rows, vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(params_ptr + row).to(tl.int32)
    if slot >= 0:
        repetition = tl.load(params_ptr + num_rows + row)
        frequency = tl.load(params_ptr + 2 * num_rows + row)
        presence = tl.load(params_ptr + 3 * num_rows + row)
        ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        valid = ids < vocab_size
        row_logits = logits_ptr + row.to(tl.int64) * logits_stride_row + ids
        table_offset = slot.to(tl.int64) * table_stride_row + ids
        logits = tl.load(row_logits, mask=valid, other=0.0).to(tl.float32)
        counts = tl.load(counts_ptr + table_offset, mask=valid, other=0)
        in_prompt = tl.load(prompt_mask_ptr + table_offset, mask=valid, other=0)
        in_output = counts > 0
        seen = in_output | (in_prompt != 0)
        penalized = tl.where(logits > 0, logits / repetition, logits * repetition)
        logits = tl.where(seen, penalized, logits)
        logits = logits - frequency * counts.to(tl.float32) - presence * in_output.to(tl.float32)
        tl.store(row_logits, logits.to(logits_ptr.dtype.element_ty), mask=valid)


def _check(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
           params: torch.Tensor) -> None:
    num_rows, vocab_size = logits.shape
    if output_counts.shape[1] != vocab_size or prompt_mask.shape != output_counts.shape:
        raise ValueError(f"tables {tuple(output_counts.shape)}/{tuple(prompt_mask.shape)} do not "
                         f"match logits {tuple(logits.shape)}")
    if params.shape != (4, num_rows) or params.dtype != torch.float32:
        raise ValueError(f"params {tuple(params.shape)} {params.dtype}: want (4, {num_rows}) "
                         "float32")


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    params: torch.Tensor) -> None:
    """Penalize ``logits`` in place.

    logits: [num_rows, vocab_size] (fp32/bf16/fp16, vocab dim contiguous)
    output_counts: [num_slots, vocab_size] int32; prompt_mask: [num_slots, vocab_size] bool
    params: [4, num_rows] fp32 (one host-to-device copy): per row its table slot (-1: no
    penalties), repetition, frequency and presence penalty
    """
    _check(logits, output_counts, prompt_mask, params)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK_SIZE))
    _penalties_kernel[grid](
        logits, output_counts, prompt_mask.view(torch.int8), params.contiguous(),
        logits.stride(0), output_counts.stride(0), num_rows, vocab_size, BLOCK=BLOCK_SIZE)


def apply_penalties_ref(logits: torch.Tensor, output_counts: torch.Tensor,
                        prompt_mask: torch.Tensor, params: torch.Tensor) -> None:
    """The same in torch, vectorized over the rows with a slot."""
    _check(logits, output_counts, prompt_mask, params)
    rows = torch.nonzero(params[0] >= 0).flatten()
    if rows.numel() == 0:
        return
    table_rows = params[0, rows].long()
    counts = output_counts[table_rows]  # [num_penalized, vocab_size]
    in_output = counts > 0
    seen = in_output | prompt_mask[table_rows]
    repetition, frequency, presence = (params[i, rows, None] for i in range(1, 4))
    selected = logits[rows].float()  # [num_penalized, vocab_size]
    selected = torch.where(seen & (selected > 0), selected / repetition,
                           torch.where(seen, selected * repetition, selected))
    selected = selected - frequency * counts - presence * in_output
    logits[rows] = selected.to(logits.dtype)
