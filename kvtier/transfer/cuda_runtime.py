"""The copies torch does not offer cheaply, from the CUDA libraries torch loaded (ctypes).

Found among the libraries already mapped into the process, so they are torch's own
CUDA runtime and the driver it runs on. ctypes releases the GIL around each call.
"""

from __future__ import annotations

import ctypes

import numpy as np

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location_hint", _MemLocation),
                ("dst_location_hint", _MemLocation), ("flags", ctypes.c_uint)]


_SOURCE_IN_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; location hints left empty


class CudaRuntime:
    """The copies torch does not offer cheaply, from the CUDA libraries torch loaded.

    ``memcpy_2d``: torch has no strided copy into pinned host memory (it stages through
    pageable memory and waits), and a layer's part of consecutive slots is strided.
    ``memcpy``: one DMA for a run of slots, without a torch op's bookkeeping.
    ``memcpy_batch``: many runs in one call (the driver's ``cuMemcpyBatchAsync``, CUDA
    13 drivers), for scattered slots: one call per slot costs copy-engine time per call,
    which a batch pays once (``kvtier bench transfer --device cuda``, scattered).
    """

    def __init__(self, library: ctypes.CDLL, batch: bool = True):
        self._library = library
        self._batch = None
        if batch:
            try:
                self._batch = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2  # 8 arguments, no failIdx
            except (OSError, AttributeError):
                self._batch = None
            else:
                self._batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                self._batch.restype = ctypes.c_int
                self._attributes = _MemcpyAttributes(_SOURCE_IN_STREAM_ORDER, _MemLocation(0, 0),
                                                     _MemLocation(0, 0), 0)
                self._first_copy = (ctypes.c_size_t * 1)(0)  # the one attribute applies from copy 0 on
        self._memcpy_2d = library.cudaMemcpy2DAsync
        self._memcpy_2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._memcpy_2d.restype = ctypes.c_int
        self._memcpy = library.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  stream: int) -> None:
        status = self._memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, _CUDA_MEMCPY_DEFAULT, stream)
        if status != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status}")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        status = self._memcpy(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)
        if status != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {status}")

    @property
    def can_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """One call for every (dst, src, size); the arrays are read during the call."""
        dsts, srcs, sizes = (np.ascontiguousarray(a, np.uint64) for a in (dsts, srcs, sizes))
        status = self._batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.size,
                             ctypes.byref(self._attributes), self._first_copy, 1, stream)
        if status != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {status}")


def load_cuda_runtime() -> CudaRuntime | None:
    """torch's CUDA runtime, or None where it cannot be found (the copier then uses torch ops)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            return CudaRuntime(ctypes.CDLL(path))
        except (OSError, AttributeError):
            continue
    return None
