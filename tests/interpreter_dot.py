"""Triton's interpreter, with a dot whose rows do not depend on where they sit in the tile.

The interpreter multiplies two tiles with numpy's ``matmul``, which for fp32 is OpenBLAS's
SGEMM. On an AMD EPYC of the Zen 5 family (cpu family 26) the kernel OpenBLAS 0.3.31 picks
rounds a row's products differently by the row's place in the tile: a [16, 200] x [200, 48]
product, each row moved to the tile's first row, 1,000 of 1,600 rows came out with another
last bit; the same with OPENBLAS_CORETYPE=Haswell or Zen, none with SkylakeX (the kernel a
Zen 4, where these tests passed, is likely given: not checked). The
kernels' batch-invariance tests compare a row alone with the same row inside a full tile, so
they failed on such a machine though the GPU kernels keep the property (a tensor-core MMA sums
each output from its own row and column in a fixed order). Here each row of an fp32 dot is
its own 1-row ``matmul`` (fp16 tiles too: numpy widens them and calls the same SGEMM): the
same shape and path wherever the row sits.
"""

from __future__ import annotations

import numpy as np


def install() -> None:
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    tile_dot = InterpreterBuilder.create_dot

    def row_by_row_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        eight_bit = 8 in (a.dtype.primitive_bitwidth, b.dtype.primitive_bitwidth)
        if d.data.dtype != np.float32 or a.data.ndim != 2 or eight_bit:
            return tile_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype)
                for i in range(a.data.shape[0])]
        return TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = row_by_row_dot
