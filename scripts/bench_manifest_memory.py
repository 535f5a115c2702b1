"""Benchmark (not a test): how much memory does restore need per manifest entry?

    python scripts/bench_manifest_memory.py [--entries 100000] [--json]

Builds a manifest of realistic entries (Inductor-like paths, one pack per 2000 files), then
measures with tracemalloc what `manifest.parse` holds afterwards and its peak while parsing, per
entry and as a multiple of the manifest's canonical size. The figures in manifest.py's comment and
docs/design.md come from here; KCACHE_MAX_MANIFEST_BYTES times the peak ratio is what a capped
manifest can cost an init container.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import tracemalloc

from kcache import limits
from kcache import manifest as manifests


def build(n: int) -> tuple[bytes, str]:
    packs = [hashlib.sha256(f"pack {i}".encode()).hexdigest() for i in range(n // 2000 + 1)]
    entries = [
        manifests.Entry(f"inductor/{i % 1000:03d}/c{i:07d}/kernel_{i}.py", 0o644, 1000 + i,
                        hashlib.sha256(str(i).encode()).hexdigest(), packs[i // 2000], i * 100, 900)
        for i in range(n)
    ]  # fmt: skip
    manifest = manifests.build("b" * 32, "t" * 32, "w" * 32, {"model.id": "m"}, ["inductor"], entries)
    return manifest.to_bytes(), manifest.id


def measure(n: int) -> dict:
    data, manifest_id = build(n)
    gc.collect()
    tracemalloc.start()
    parsed = manifests.parse(data, manifest_id)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(parsed.entries) == n
    per_entry_bytes = len(data) / n
    peak_with_input = peak + len(data)
    cap = limits.DEFAULT_MANIFEST_BYTES
    return {
        "entries": n,
        "manifest_bytes_per_entry": round(per_entry_bytes, 1),
        "held_bytes_per_entry": round(held / n, 1),
        "peak_bytes_per_entry_with_input": round(peak_with_input / n, 1),
        "peak_over_manifest_size": round(peak_with_input / len(data), 2),
        "default_cap_entries": int(cap / per_entry_bytes),
        "default_cap_peak_mib": round(cap * peak_with_input / len(data) / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.entries)
    if args.json:
        print(json.dumps(result))
        return
    for name, value in result.items():
        print(f"{name:34} {value}")


if __name__ == "__main__":
    main()
