"""Host -> device 2D copies on a given stream (``cudaMemcpy2DAsync``), for loads in layer
groups (kv_tiers.py): a group's bytes of a run of consecutive arena slots are ``height``
rows of ``width`` bytes, ``src_pitch`` (a slot) apart. torch's ``copy_`` of such a
non-contiguous pinned view would first make a contiguous host copy, synchronously.

Bound with ctypes to the libcudart that torch itself loaded (found in /proc/self/maps once
CUDA is initialized: the same runtime, so the same context and streams), else through
``cuda.bindings.runtime`` when importable; with neither, ``memcpy_2d`` raises a clear error
(the worker calls it at start when ``--kv-load-layer-groups`` > 1).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch

HOST_TO_DEVICE = 1  # cudaMemcpyKind cudaMemcpyHostToDevice

# (dst, dst_pitch, src, src_pitch, width, height, stream handle): pointers and sizes in bytes
Memcpy2D = Callable[[int, int, int, int, int, int, int], None]


def cudart_path(maps: str) -> str | None:
    """The first libcudart mapped, from the text of /proc/self/maps (None: none)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            path = fields[5].removesuffix(" (deleted)")
            name = os.path.basename(path)
            if name.startswith("libcudart") and ".so" in name:
                return path
    return None


def bind_cudart(lib) -> Memcpy2D:
    """The copy through a loaded libcudart (a ``ctypes.CDLL``), return codes checked."""
    copy = lib.cudaMemcpy2DAsync
    copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                     ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    error_string = lib.cudaGetErrorString
    error_string.argtypes = [ctypes.c_int]
    error_string.restype = ctypes.c_char_p

    def memcpy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  stream: int) -> None:
        code = copy(dst, dst_pitch, src, src_pitch, width, height, HOST_TO_DEVICE, stream)
        if code != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: error {code} "
                               f"({(error_string(code) or b'?').decode()})")
    return memcpy_2d


def bind_cuda_bindings(runtime) -> Memcpy2D:
    """The copy through ``cuda.bindings.runtime`` (cuda-python), return codes checked."""
    kind = runtime.cudaMemcpyKind(HOST_TO_DEVICE)

    def memcpy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  stream: int) -> None:
        code = int(runtime.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                             kind, stream)[0])
        if code != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: error {code} (cuda.bindings)")
    return memcpy_2d


@functools.cache
def memcpy_2d() -> Memcpy2D:
    """The host->device 2D copy, bound once; RuntimeError saying why when it cannot be."""
    if not torch.cuda.is_available():
        raise RuntimeError("cudaMemcpy2DAsync needs CUDA: none is available")
    torch.cuda.init()  # torch's libcudart is loaded by now
    tried = []
    path = cudart_path(Path("/proc/self/maps").read_text())
    if path is not None:
        try:
            return bind_cudart(ctypes.CDLL(path))
        except (OSError, AttributeError) as exc:
            tried.append(f"{path}: {exc}")
    else:
        tried.append("no libcudart in /proc/self/maps (torch may link it statically)")
    try:
        from cuda.bindings import runtime
        return bind_cuda_bindings(runtime)
    except (ImportError, AttributeError) as exc:
        tried.append(f"cuda.bindings.runtime: {exc}")
    raise RuntimeError("loads in layer groups (--kv-load-layer-groups > 1) need "
                       "cudaMemcpy2DAsync, and it could not be bound: " + "; ".join(tried))


def check_memcpy_2d(device: torch.device) -> None:
    """Bind the copy and check it on a small strided region (a wrong binding fails here, at
    start, not in a step); RuntimeError when it is wrong or unavailable."""
    copy = memcpy_2d()
    # [3, 8] int32 rows, pinned; its [:, 2:6] (16 bytes of each 32-byte row) into [3, 4]
    host = torch.arange(24, dtype=torch.int32).view(3, 8).pin_memory()
    dest = torch.zeros(3, 4, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    copy(dest.data_ptr(), 16, host.data_ptr() + 8, 32, 16, 3, stream.cuda_stream)
    stream.synchronize()
    if not torch.equal(dest.cpu(), host[:, 2:6]):
        raise RuntimeError(f"cudaMemcpy2DAsync copied {dest.cpu().tolist()}, not "
                           f"{host[:, 2:6].tolist()}: the binding is wrong")
