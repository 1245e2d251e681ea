"""Bytes the C allocator has handed out, read from glibc's ``mallinfo2``: what a CPU run really holds,
measured without tracking tensors (the planner's instrument and tests/helpers/allocated.py both
follow tensor storages; this one would see memory neither of them knows about).

torch's CPU allocator takes every tensor's memory from ``posix_memalign``. Blocks above glibc's mmap
threshold are mapped one by one and counted in ``hblkhd`` whichever thread allocated them; smaller
ones come from arenas, of which ``mallinfo2`` reports the main one (``uordblks``). The threshold is
fixed at 64 KiB here (:func:`fix_mmap_threshold`; glibc would otherwise raise it as large blocks are
freed) so that every tensor of any size is counted. :class:`PeakMalloc` samples after every aten op,
which is when a new output has been allocated and its inputs are not yet freed: the peak between
two samples is not missed except inside a kernel (its own scratch)."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["available", "fix_mmap_threshold", "in_use", "PeakMalloc"]

_M_MMAP_THRESHOLD = -3
_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


_LIBC = _libc()


def available() -> bool:
    """Whether this C library has ``mallinfo2`` (glibc 2.33 and later)."""
    return _LIBC is not None and hasattr(_LIBC, "mallinfo2")


def fix_mmap_threshold(nbytes: int = 64 * 1024) -> None:
    _LIBC.mallopt(_M_MMAP_THRESHOLD, nbytes)


def in_use() -> int:
    """Bytes allocated and not freed: the main arena's plus every mmapped block's."""
    _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakMalloc(TorchDispatchMode):
    """``peak``: the most bytes in use above the level at entry, sampled after every aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.base = 0
        self.peak = 0

    def __enter__(self) -> PeakMalloc:
        self.base = in_use()
        self.peak = 0
        return super().__enter__()

    def now(self) -> int:
        return in_use() - self.base

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.now())
        return out
