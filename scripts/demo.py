"""kcache end to end on one machine: a cold pod publishes, a fresh pod restores and starts warm.

    python scripts/demo.py [--blocks N] [--dim D] [--seq S] [--home DIR] [--keep] [--json]

Two "pods" are two fresh directories under one temporary work dir:

    kcache-demo-XXXX/
      home/     KCACHE_HOME: file:// store + SQLite index (empty unless --home is given)
      pod-a/    restore (miss) -> cold workload compiles here -> publish --from pod-a
      pod-b/    restore (hit)  -> warm workload reads the restored cache

Every step is a fresh process (the kcache CLI, then ``python -m kcache.torch.workload``) with the
exports of ROOT/kcache.env, exactly as a model container would source them. The demo fails
(exit 1) unless the warm run was a full hit: no graph or autograd misses, no compiled artifacts,
and the same output checksum as the cold run. A step that breaks exits 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _procs

Say = Callable[[str], None]
RUN_FIELDS = (
    "fxgraph_hit",
    "fxgraph_miss",
    "aotautograd_hit",
    "aotautograd_miss",
    "compiled_artifacts",
    "output_checksum",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument(
        "--home", type=Path, help="use this KCACHE_HOME instead of a fresh empty one (the first run may then hit)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir and print where it is")
    parser.add_argument("--json", action="store_true", help="print one JSON object; narration goes to stderr")
    return parser.parse_args(argv)


def run_steps(work: Path, home: Path, args: argparse.Namespace, say: Say) -> dict[str, Any]:
    """The five steps of the workflow; returns every payload for the summary."""
    model = _procs.model_id(args.blocks, args.dim, args.seq)
    shape = (args.blocks, args.dim, args.seq)
    base = _procs.base_env(home)
    pod_a, pod_b = work / "pod-a", work / "pod-b"

    first, _ = _procs.restore(pod_a, model, base)
    say(
        f"1/5 restore into pod-a: {first['status']} ({first.get('reason') or 'bundle ' + str(first['bundle_id'])[:12]})"
    )
    cold, cold_wall = _procs.run_workload(_procs.env_for(pod_a, base), *shape)
    say(f"2/5 cold workload in pod-a: first output after {cold['seconds']:.2f} s "
        f"({cold['compiled_artifacts']} compiled artifacts)")  # fmt: skip
    published, _ = _procs.publish(pod_a, model, base)
    say(f"3/5 publish from pod-a: bundle {published['bundle_id'][:12]}, {published['files']} files, "
        f"{published['bytes'] / 1e6:.1f} MB raw, {published['uploaded_bytes'] / 1e6:.1f} MB packed")  # fmt: skip
    second, restore_wall = _procs.restore(pod_b, model, base)
    say(f"4/5 restore into pod-b: {second['status']}, {second['files']} files in {second['seconds']:.2f} s "
        f"({restore_wall:.2f} s with CLI start-up)")  # fmt: skip
    warm, warm_wall = _procs.run_workload(_procs.env_for(pod_b, base), *shape)
    say(f"5/5 warm workload in pod-b: first output after {warm['seconds']:.2f} s "
        f"({warm['compiled_artifacts']} compiled artifacts)")  # fmt: skip
    return {"first_restore": first, "cold": cold, "cold_wall": cold_wall, "publish": published,
            "restore": second, "restore_wall": restore_wall, "warm": warm, "warm_wall": warm_wall}  # fmt: skip


def problems(steps: dict[str, Any]) -> list[str]:
    """Why the warm start does not count as a full restore; empty when it does."""
    warm, cold = steps["warm"], steps["cold"]
    found = []
    if steps["restore"]["status"] != "hit":
        found.append(f"restore into pod-b was a {steps['restore']['status']}: {steps['restore']['reason']}")
    if warm["fxgraph_miss"] or warm["aotautograd_miss"]:
        found.append(f"warm run missed (fxgraph {warm['fxgraph_miss']}, aotautograd {warm['aotautograd_miss']})")
    if warm["compiled_artifacts"]:
        found.append(f"warm run compiled {warm['compiled_artifacts']} artifacts: kernels were rebuilt")
    if warm["output_checksum"] != cold["output_checksum"]:
        found.append(f"output checksums differ: cold {cold['output_checksum']}, warm {warm['output_checksum']}")
    return found


def summary(steps: dict[str, Any]) -> dict[str, Any]:
    cold, warm = steps["cold"], steps["warm"]
    return {
        "cold_seconds": cold["seconds"],
        "warm_seconds": warm["seconds"],
        "speedup": round(cold["seconds"] / warm["seconds"], 2),
        "cold_wall_seconds": round(steps["cold_wall"], 3),
        "warm_wall_seconds": round(steps["warm_wall"], 3),
        "restore_seconds": steps["restore"]["seconds"],
        "restore_wall_seconds": round(steps["restore_wall"], 3),
        "bundle_id": steps["publish"]["bundle_id"],
        "bundle_files": steps["publish"]["files"],
        "bundle_bytes": steps["publish"]["bytes"],
        "bundle_packed_bytes": steps["publish"]["uploaded_bytes"],
        "cold": {k: cold[k] for k in RUN_FIELDS},
        "warm": {k: warm[k] for k in RUN_FIELDS},
        "checksums_match": cold["output_checksum"] == warm["output_checksum"],
    }


def print_summary(s: dict[str, Any], found: list[str]) -> None:
    row = "  {:<20}{:>15}{:>15}"
    print()
    print(row.format("", "cold pod-a", "warm pod-b"))
    print(row.format("first output (s)", f"{s['cold_seconds']:.2f}", f"{s['warm_seconds']:.2f}"))
    print(row.format("process wall (s)", f"{s['cold_wall_seconds']:.2f}", f"{s['warm_wall_seconds']:.2f}"))
    for kind in ("fxgraph", "aotautograd"):
        cells = [f"{s[run][kind + '_hit']} hit/{s[run][kind + '_miss']} miss" for run in ("cold", "warm")]
        print(row.format(f"{kind} cache", *cells))
    print(row.format("compiled artifacts", s["cold"]["compiled_artifacts"], s["warm"]["compiled_artifacts"]))
    print(row.format("output checksum", s["cold"]["output_checksum"], s["warm"]["output_checksum"]))
    print(f"  speedup {s['speedup']:.1f}x; restore {s['restore_seconds']:.2f} s "
          f"({s['restore_wall_seconds']:.2f} s with CLI start-up); bundle {s['bundle_files']} files, "
          f"{s['bundle_bytes'] / 1e6:.1f} MB raw, {s['bundle_packed_bytes'] / 1e6:.1f} MB packed; "
          f"checksums {'match' if s['checksums_match'] else 'DIFFER'}")  # fmt: skip
    print("  result: " + ("warm start fully restored" if not found else "FAILED: " + "; ".join(found)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _procs.compile_kcache()
    work = Path(tempfile.mkdtemp(prefix="kcache-demo-"))
    home = args.home.absolute() if args.home else work / "home"
    stream = sys.stderr if args.json else sys.stdout
    say: Say = lambda line: print(line, file=stream, flush=True)  # noqa: E731
    say(f"kcache demo: {args.blocks} blocks, dim {args.dim}, seq {args.seq}; KCACHE_HOME={home}")
    try:
        steps = run_steps(work, home, args, say)
    except _procs.StepFailed as exc:
        print(f"demo: a step failed: {exc.details()}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            say(f"kept work dir {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    found = problems(steps)
    result = summary(steps)
    if args.json:
        print(json.dumps({**result, "ok": not found, "problems": found}, sort_keys=True))
    else:
        print_summary(result, found)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
