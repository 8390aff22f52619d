"""glibc malloc settings for the buffer process, so large buffers are reused instead of re-faulted.

Every group passes through the buffer as a handful of large buffers: the request's bytes from
rollout (~600 KB for 4 groups), the Redis command that stores them, the Redis reply that reads
them back, and the batch sent to the trainer (~5 MB for 32 groups). glibc serves blocks above its
mmap threshold with fresh mmaps, and trims the heap top back to the kernel once more than twice
that is free, so each such buffer is new memory whose pages fault in, are zeroed by the kernel
and are handed back when freed, which puts a large share of the buffer's CPU time in the kernel.
Raising the mmap and trim thresholds keeps freed blocks in the heap for the next request (the
measured effect is in docs/buffer.md). The cost is that up to TRIM_THRESHOLD of freed memory
stays with the process.

`kuberl serve buffer` calls `keep_freed_memory()` once at start (`create_service`). It does
nothing on a libc without `mallopt` (musl, macOS) and leaves alone any setting chosen with glibc's
MALLOC_*_ environment variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from kuberl.common.logs import get_logger

log = get_logger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): blocks up to a batch of
# ~200 groups come from the heap.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 128 * 1024 * 1024
TOP_PAD = 16 * 1024 * 1024

_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    "MALLOC_TOP_PAD_": (M_TOP_PAD, TOP_PAD),
}


def keep_freed_memory() -> dict[str, int]:
    """Apply the settings above where the environment did not choose; what was applied."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = {}
    for env, (param, value) in _SETTINGS.items():
        if env in os.environ:
            continue
        if mallopt(param, value) == 1:
            applied[env] = value
    log.debug("malloc.tuned", **{k.lower().strip("_"): v for k, v in applied.items()})
    return applied
