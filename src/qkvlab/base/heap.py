"""Keep the memory a CPU training step frees inside the process, for the next step to reuse.

PyTorch's CPU allocator is plain malloc. glibc serves a block above its mmap threshold with a fresh
mapping and unmaps it on free, and trims the heap's free top back to the OS: every step of a model
then touches its activations, logits and gradients on pages the kernel has to fault in and zero
again, every step (benchmarks/heap_hold.py measures both ways alternately). Raising the mmap threshold and switching off trimming
makes the heap a cache: a step's peak stays mapped and the next step reuses it, which is what CUDA's
caching allocator and the jemalloc/tcmalloc LD_PRELOAD of Intel's PyTorch guides do.

Process-wide and permanent (the peak is not given back until exit), so only training calls it
(train.loop and bench's training figure, on the CPU). mmap stays allowed: a thread's arena that cannot grow still falls back to
it. Outside glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, glibc's malloc.h
MMAP_THRESHOLD = 1 << 30  # blocks above 1 GiB still get their own mapping
NEVER_TRIM = 2**31 - 1  # mallopt takes an int

_held = False


def hold_freed_memory() -> bool:
    """Make glibc's heap keep what is freed (see the module doc). True if it now does."""
    global _held
    if not _held:
        mallopt = getattr(_libc(), "mallopt", None)
        if mallopt is None:
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        _held = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _held


def _libc():
    try:
        return ctypes.CDLL(None)  # the symbols already loaded: libc's among them on Linux
    except (OSError, TypeError):  # Windows has no such handle
        return None
