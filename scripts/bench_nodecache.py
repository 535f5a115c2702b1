"""Benchmark (not a test): N pods restoring one bundle on one node, with and without the node cache.

    python scripts/bench_nodecache.py [--files 2000] [--big 2] [--pods 8] [--json] [--keep]

One bundle (bench_store's synthetic tree of --files small files, plus --big random files of 16 MiB,
each a pack of its own) is published to a moto S3 server in its own process. Then, each scenario
with fresh restore roots, --pods `kcache restore` processes start at once, as pods scheduled onto
one node do:

    store           no node cache: every pod reads every pack from S3
    cold-node       --node-cache on an empty directory: the first pod to ask fetches a pack, the others wait
    prefetched      after `kcache prefetch --once` (timed separately): packs come from local disk
    one-store / one-prefetched   a single restore each way, for the per-pod cost

Reported per scenario: wall seconds until the last pod finished, the pack GETs the S3 server served
and how many distinct packs they were for (from its request log), and that every pod hit. Scratch space: one temp dir,
removed unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_store as bench

MODEL = "bench-nodecache"
PACK_GET = re.compile(r'"\S*GET /\S*/packs/\S+/(\w+) HTTP/1\.1\S*" 20[06] ')


def pack_gets(log: Path) -> list[str]:
    """The pack of every pack GET in moto's request log so far (it logs no byte counts)."""
    return PACK_GET.findall(log.read_text(errors="replace"))


def restore_argv(url: str, endpoint: str, root: Path, node: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "kcache", "restore", "--into", str(root), "--model", MODEL, "--store", url,
            "--s3-endpoint-url", endpoint, "--index", "none", "--strict", "--json"]  # fmt: skip
    return argv + (["--node-cache", str(node)] if node else [])


def pods(work: Path, env, url: str, endpoint: str, name: str, count: int, node: Path | None) -> dict:
    """`count` restores started together; the wall time until the last one finished."""
    before = pack_gets(work / "moto.log")
    started = time.perf_counter()
    procs = [subprocess.Popen(restore_argv(url, endpoint, work / "out" / f"{name}-{i}", node), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(count)]  # fmt: skip
    outputs = [p.communicate() for p in procs]
    seconds = time.perf_counter() - started
    statuses = []
    for proc, (out, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise bench.BenchError(f"restore exited {proc.returncode}: {err.decode()[-2000:]}")
        statuses.append(json.loads(out)["status"])
    time.sleep(0.5)  # moto writes its request log after the response; let the last lines land
    after = pack_gets(work / "moto.log")
    shutil.rmtree(work / "out", ignore_errors=True)
    return row(name, count, seconds, after[len(before) :], all_hit=statuses == ["hit"] * count)


def row(name: str, count: int, seconds: float, gets: list[str], *, all_hit: bool) -> dict:
    return {"scenario": name, "pods": count, "seconds": round(seconds, 3), "pack_gets": len(gets),
            "packs_fetched": len(set(gets)), "all_hit": all_hit}  # fmt: skip


def run(args: argparse.Namespace, work: Path) -> dict:
    env = bench.base_env(work)
    src = work / "tree"
    bench.build_synthetic(src, args.files, seed=7)
    for i in range(args.big):
        path = src / "inductor" / "big" / f"weights_{i}.so"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(16 * 1024 * 1024))
    with bench.moto_server(work, env) as endpoint:
        bench.s3_client(endpoint).create_bucket(Bucket="bench")
        url = "s3://bench/cache"
        bench.run_child([sys.executable, "-m", "kcache", "publish", "--from", str(src), "--model", MODEL, "--store",
                         url, "--s3-endpoint-url", endpoint, "--index", f"sqlite:///{work / 'pub.db'}", "--json"],
                        env)  # fmt: skip
        rows = [pods(work, env, url, endpoint, "store", args.pods, None),
                pods(work, env, url, endpoint, "cold-node", args.pods, work / "node-cold")]  # fmt: skip
        before = pack_gets(work / "moto.log")
        prefetch = bench.run_child([sys.executable, "-m", "kcache", "prefetch", "--node-cache", str(work / "node"),
                                    "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint, "--index",
                                    "none", "--once", "--json"], env)  # fmt: skip
        time.sleep(0.5)
        after = pack_gets(work / "moto.log")
        rows.append(row("prefetch", 0, prefetch.seconds, after[len(before) :], all_hit=True))
        rows += [pods(work, env, url, endpoint, "prefetched", args.pods, work / "node"),
                 pods(work, env, url, endpoint, "one-store", 1, None),
                 pods(work, env, url, endpoint, "one-prefetched", 1, work / "node")]  # fmt: skip
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    return {"tree_bytes": size, "files": args.files + args.big, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--big", type=int, default=2)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kcache-bench-nodecache-"))
    try:
        out = run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"bundle: {out['files']} files, {out['tree_bytes'] / 1e6:.1f} MB")
    print(f"{'scenario':<16}{'pods':>5}{'seconds':>10}{'pack GETs':>11}{'packs':>7}  all hit")
    for r in out["rows"]:
        print(f"{r['scenario']:<16}{r['pods']:>5}{r['seconds']:>10.2f}{r['pack_gets']:>11}"
              f"{r['packs_fetched']:>7}  {r['all_hit']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
