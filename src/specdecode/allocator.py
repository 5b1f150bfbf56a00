"""Keep freed memory inside the process (glibc malloc), so that the large tensors every forward and training step
allocates anew reuse pages already mapped instead of faulting fresh ones in each time.

glibc serves an allocation above its mmap threshold (which it raises dynamically, to at most 32 MiB) with new pages
and unmaps them on free, and returns the heap's free top to the kernel past its trim threshold. A training step's
[batch, steps x tokens, draft vocabulary] logits, or a prefill's [prompt, intermediate] activations, then cost page
faults on every step: time spent in the kernel that tcmalloc or jemalloc (which PyTorch's CPU tuning guides
recommend) would not spend. Raising both thresholds gives the same effect with the allocator already loaded. The
price: the process keeps its peak heap mapped until it exits (the memory a step needs is needed again next step)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = 2**31 - 1  # never hand the heap's free top back
TOP_PAD = 64 << 20  # grow the heap 64 MiB beyond each request (fewer brk calls)


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process (Linux with glibc); False where there is no glibc mallopt (musl,
    macOS, Windows) or it refused a value: nothing changes then."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
