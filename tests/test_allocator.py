"""kcache.allocator: a MiB-sized buffer comes from the reusable heap, not from a fresh mmap.

Each case runs in a fresh process, so the allocator's settings start from glibc's defaults.
"""

import json
import subprocess
import sys

import pytest

ALLOCATE = """
import json, sys
from kcache.allocator import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "on" else None
size = 8 << 20

def regions():
    return set(open("/proc/self/maps").read().splitlines())

before = regions()
buffer = bytearray(size)  # a fetch thread's pieces are this kind of buffer
mapped = []
for line in regions() - before:
    start, end = (int(x, 16) for x in line.split()[0].split("-"))
    if end - start >= size and "[heap]" not in line:
        mapped.append(line)  # its own mapping: freed, it goes back to the kernel and faults in anew
print(json.dumps({"applied": applied, "mapped": len(mapped)}))
"""


def allocate(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ALLOCATE, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and /proc/self/maps are Linux's")
def test_big_buffers_come_from_the_heap_once_freed_memory_is_kept():
    assert allocate("off")["mapped"] == 1  # glibc's default: a buffer over 128 KiB is its own mmap
    on = allocate("on")
    assert on == {"applied": True, "mapped": 0}


HOLD = """
import gc, json, sys
from kcache.allocator import fewer_collections
if sys.argv[1] == "on":
    fewer_collections()
counts = [0, 0, 0]
gc.callbacks.append(lambda phase, info: phase == "start" and counts.__setitem__(info["generation"],
                                                                                 counts[info["generation"]] + 1))
held = [{"path": str(i), "size": i} for i in range(200_000)]  # what a 20k-file publish keeps alive
print(json.dumps(counts))
"""


def collections(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", HOLD, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_fewer_collections_stops_the_collector_walking_what_a_publish_holds():
    default, fewer = collections("off"), collections("on")
    assert default[0] > 100 and default[2] >= 1  # the default collector runs hundreds of times, fully at least once
    assert fewer[0] < default[0] / 20 and fewer[2] == 0
