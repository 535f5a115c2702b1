"""Keep freed buffers for reuse: restore and publish stream gigabytes through buffers of a MiB.

glibc's malloc serves a buffer that large with mmap, or trims it from the heap when freed, so
every MiB read, decompressed or hashed lands in memory the kernel must fault in and zero again.
On the 2-core VM the benchmarks run on that was a third of restore's system time (a 1 GiB bundle:
~95k page faults; ~34k with the settings below) and, through the host reclaiming guest pages, most
of its run-to-run spread. With a fixed mmap threshold and a high trim threshold, a freed buffer is
reused hot by the next read. What stays allocated is bounded by what is in flight at once (the
fetch threads' pieces), not by the bundle, as long as the threads share one arena: glibc gives each
thread an arena of its own, which kept what that thread had once held, so 16 fetch threads each kept
their largest buffers (a 4 MiB blob read, a decoder window) and a restore beside a manifest at the cap
peaked at ~300 MiB where the threads never held more than ~50 MiB at once. Python allocates under its
GIL, so one arena costs no waiting.

Other C libraries (musl) have no mallopt: then nothing changes.

`fewer_collections` is the same kind of setting for Python's cyclic garbage collector: a publish
of 20k files keeps ~100k small containers alive (walk entries, paths, rows, manifest entries) and
makes almost no cycles, yet with the default thresholds the collector traversed them over and over
(13% of publish's CPU samples; 5 alternating runs each: 3.30 s -> 2.87 s wall).
"""

from __future__ import annotations

import ctypes
import gc
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENAS = 1  # every thread's buffers in one arena: freed by one thread, reused by the next
MMAP_THRESHOLD = 32 * 1024 * 1024  # buffers below this come from the heap, and are reused
TRIM_THRESHOLD = 256 * 1024 * 1024  # free heap kept before it is handed back to the kernel
# Allocations between young collections, and young (then middle) collections between older ones.
GC_THRESHOLDS = (50_000, 50, 100)


def reuse_freed_memory() -> bool:
    """Tell glibc to keep freed buffers for reuse; False where that cannot be said (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The interpreter's own symbols include its C library's: no find_library, which runs ldconfig.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            and bool(mallopt(M_ARENA_MAX, ARENAS)))


def fewer_collections() -> None:
    """Collect cycles far less often, for a command that holds many objects and makes few cycles.

    For a CLI command's process only: a library caller's (a torch process') collector is its own.
    """
    gc.set_threshold(*GC_THRESHOLDS)
