"""Tolerances shared by the kernel tests."""

from __future__ import annotations

import torch


def double_rounding(dtype: torch.dtype) -> dict:
    """assert_close tolerances for a kernel that rounds once where its reference rounds twice.

    fp16 keeps 10 mantissa bits, so the two may differ by two steps of 2**-11..2**-10
    relative, over assert_close's default rtol of 1e-3 for fp16; bf16's default allows it.
    """
    return {"rtol": 2 ** -9, "atol": 1e-5} if dtype == torch.float16 else {}
