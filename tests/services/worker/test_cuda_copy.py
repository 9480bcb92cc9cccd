"""The host->device 2D copy's binding (cuda_copy.py): torch's libcudart found in
/proc/self/maps, arguments passed in cudaMemcpy2DAsync's order with the host->device kind,
return codes checked, a clear error without CUDA; on the GPU (pytest -m gpu) a strided copy
on a stream."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from services.worker import cuda_copy

MAPS = """\
7f1c2a000000-7f1c2a021000 rw-p 00000000 00:00 0
7f1c2b000000-7f1c2b0a0000 r-xp 00000000 103:02 1234   /venv/lib/python3.11/site-packages/torch/lib/libc10_cuda.so
7f1c2c000000-7f1c2c0b0000 r-xp 00000000 103:02 5678   /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13
7f1c2c0b0000-7f1c2c0c0000 r--p 000b0000 103:02 5678   /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13
"""


def test_torchs_libcudart_is_found_in_the_maps():
    assert cuda_copy.cudart_path(MAPS) == \
        "/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13"
    hashed = "7f00-7f10 r-xp 00000000 00:01 9 /torch/lib/libcudart-9335f6a2.so.12 (deleted)\n"
    assert cuda_copy.cudart_path(hashed) == "/torch/lib/libcudart-9335f6a2.so.12"
    assert cuda_copy.cudart_path(MAPS.splitlines()[1] + "\n") is None
    assert cuda_copy.cudart_path("") is None


class FakeFunction:
    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def test_the_ctypes_binding_passes_the_arguments_in_order_and_checks_the_result():
    lib = types.SimpleNamespace(cudaMemcpy2DAsync=FakeFunction(0),
                                cudaGetErrorString=FakeFunction(b"invalid pitch argument"))
    copy = cuda_copy.bind_cudart(lib)
    assert lib.cudaMemcpy2DAsync.argtypes[6] is ctypes.c_int
    assert lib.cudaMemcpy2DAsync.restype is ctypes.c_int
    copy(1000, 64, 2000, 256, 64, 7, 42)
    assert lib.cudaMemcpy2DAsync.calls == [(1000, 64, 2000, 256, 64, 7, 1, 42)]
    lib.cudaMemcpy2DAsync.result = 12
    with pytest.raises(RuntimeError, match=r"error 12 \(invalid pitch argument\)"):
        copy(1000, 64, 2000, 32, 64, 7, 42)


def test_the_cuda_bindings_binding_checks_the_result():
    calls = []

    def memcpy(*args):
        calls.append(args)
        return (len(calls) - 1,)  # success first, then error 1
    runtime = types.SimpleNamespace(cudaMemcpyKind=lambda value: ("kind", value),
                                    cudaMemcpy2DAsync=memcpy)
    copy = cuda_copy.bind_cuda_bindings(runtime)
    copy(1, 2, 3, 4, 5, 6, 7)
    assert calls == [(1, 2, 3, 4, 5, 6, ("kind", 1), 7)]
    with pytest.raises(RuntimeError, match="error 1"):
        copy(1, 2, 3, 4, 5, 6, 7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_without_cuda_the_copy_is_refused_clearly():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cuda_copy.memcpy_2d()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_strided_region_is_copied_on_the_stream():
    cuda_copy.check_memcpy_2d(torch.device("cuda"))  # raises when wrong
    stream = torch.cuda.Stream()
    host = torch.randn(64, 96).pin_memory()  # [64 rows, 96] fp32: rows of 384 bytes
    dest = torch.empty(64, 40, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the copy queues behind this on the stream
        cuda_copy.memcpy_2d()(dest.data_ptr(), 160, host.data_ptr() + 4 * 16, 384, 160, 64,
                              stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(dest.cpu(), host[:, 16:56])
