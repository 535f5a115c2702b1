"""Benchmark (not a test): kcache's packed store against s5cmd, `aws s3 sync` and a local tar|zstd floor.

    python scripts/bench_store.py [--files 20000] [--big-files 64] [--big-mib 16] [--shapes synthetic,big]
                                  [--baselines s5cmd,aws] [--repeats 3] [--quick] [--json] [--keep]

Trees, each laid out like a restore root (ROOT/inductor, ROOT/triton, ROOT/tmp/...):

    synthetic   --files files of 1-16 KiB (log-uniform) plus a few files of several MiB, about
                150 MB at the defaults; half random bytes, half repetitive kernel-like text, so
                zstd finds roughly what it finds in real caches. A copy 4x smaller is restored too,
                to show that restore's peak memory does not grow with the bundle.
    big         --big-files files of --big-mib MiB each (1 GiB at the defaults), random-ish data (runs
                of random bytes and kernel-like text): the shape of large vLLM/TensorRT caches
    inductor    a real Inductor cache: `python -m kcache.torch.workload` with TORCHINDUCTOR_CACHE_DIR and
                TMPDIR inside ROOT (skipped when torch is not importable)

Targets go by a tree's shape: files averaging under 1 MiB make a small-file tree (kcache must beat
per-object tools by far there), larger ones a big-file tree (kcache must keep up with them); the
report names each tree's shape. The big tree is not split by restore (64 blobs of 16 MiB keep 16 threads busy one stream each).
A bundle of a few huge files is: each blob's parts are ranged GETs of the same object, and moto
copies the whole object for every ranged GET, so on moto such a restore (and s5cmd's own ranged
download of it) pays for the server's copies; S3 and file:// read only the range.

Each repeat uses a fresh bucket, fresh SQLite indexes and fresh target directories, against one
moto S3 server that runs as a separate process on 127.0.0.1. Every operation is timed as a whole
child process (wall clock), because that is what a pod's init container pays (for restores the
report also gives the restore's own `seconds` from its JSON: the rest is start-up and exit):

    publish / republish   kcache publish to s3:// into an empty store, then again unchanged
    restore               kcache restore from s3:// into a fresh dir, through refs/ as the example
                          init container does (KCACHE_INDEX=none)
    restore-index         the same through the SQLite index the publish wrote
    sync-up / sync-down   aws s3 sync ROOT s3://bucket/sync/ and back into a fresh dir
    s5cmd-up / s5cmd-down s5cmd cp ROOT/ s3://bucket/s5/ and back (the fastest per-object S3 tool)
    tar-create / -extract tar -cf - | zstd -T0 and zstd -dc | tar -xf - on local disk: the floor
    publish-file / restore-file   the same kcache commands against a file:// store

Every restored tree is compared with its source (all paths and sizes, a sample of SHA-256s), so a
fast but wrong restore cannot win. Scratch space lives in one temp dir (under --scratch DIR when
given), removed unless --keep:

    kcache-bench-store-XXXX/
      trees/<tree>/         sources, pruned to exactly what `kcache publish --from` carries
      out/<tree>-<op>-<n>/  restore targets, removed after verification
      spent/                verified targets of many files, deleted after the last measurement
                            (deleting them at once slows the next restore: see Ctx.discard)
      files/                file:// stores, indexes, tar.zst archives
      home/                 KCACHE_HOME, so no user store or index leaks in
      moto.log              the S3 server's request log
      moto-tmp/             where the S3 server keeps objects: moto spools any over ~5 MiB to a
                            temp file, which must live on the scratch's file system too
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import _procs  # noqa: E402  (scripts/ is sys.path[0] when this file runs as a script)
import boto3

from kcache import publish as publishing
from kcache import sources

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# Inherited cache locations or kcache settings would point children past the scratch dir.
ISOLATED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR", "TORCH_COMPILE_CACHE_KEY_TAG",
            "KCACHE_STORE", "KCACHE_INDEX", "KCACHE_HOME", "AWS_ENDPOINT_URL", "AWS_PROFILE")  # fmt: skip
RESTORE_EXTRAS = {"kcache.env", ".kcache-state.json", ".kcache-lock", ".kcache-restored"}  # written by restore, not part of the bundle
HASH_SAMPLE = 200
SPENT_FILES = 1000  # a verified tree of at least this many files is deleted at the end (Ctx.discard)
SEED = 20240611
# (trees it applies to, label, numerator op, denominator op, bound, "min": ratio must reach bound,
# "max": stay at or below). Many small files: kcache must beat per-object tools by far; a few big
# files: per-object tools are at their best, and kcache must still keep up with them.
# Trees go by shape, not name: a tree whose files average under SMALL_FILE_BYTES is a small-file tree,
# where per-object tools pay per file; the rest are big-file trees. The real Inductor tree is either,
# depending on torch and the workload (torch 2.13's CPU workload: 36 files averaging 4.4 MB, most of
# it one precompiled header), and 20x faster than s5cmd over 36 objects is no tool's target.
SMALL, BIG = ("small",), ("big",)
SMALL_FILE_BYTES = 1 << 20
TARGETS = ((SMALL, "aws-sync-down / kcache-restore", "sync-down", "restore", 20.0, "min"),
           (SMALL, "aws-sync-up / kcache-publish", "sync-up", "publish", 20.0, "min"),
           (SMALL, "s5cmd-down / kcache-restore", "s5cmd-down", "restore", 20.0, "min"),
           (SMALL, "s5cmd-up / kcache-publish", "s5cmd-up", "publish", 20.0, "min"),
           (BIG, "kcache-restore / s5cmd-down", "restore", "s5cmd-down", 1.0, "max"),
           (BIG, "kcache-publish / s5cmd-up", "publish", "s5cmd-up", 1.0, "max"),
           (SMALL + BIG, "kcache-restore-file / tar-zstd-extract", "restore-file", "tar-extract", 1.5, "max"),
           (SMALL + BIG, "republish / publish", "republish", "publish", 0.1, "max"))  # fmt: skip


class BenchError(Exception):
    """A step failed or produced a wrong tree; the message says which and why."""


@dataclass(frozen=True)
class Run:
    seconds: float  # wall clock of the whole child process
    maxrss: int  # bytes, the child's peak resident set (from wait4)
    stdout: str
    cpu: float = 0.0  # user + system seconds of the child and the children it waited for
    server_cpu: float = 0.0  # CPU seconds the S3 server spent meanwhile (its /proc/PID/stat)


@dataclass(frozen=True)
class Tree:
    name: str
    root: Path
    listing: dict[str, int]  # relative path -> size, exactly what kcache carries
    sample: tuple[str, ...]  # paths whose SHA-256 is compared after every restore
    note: str = ""


# ---- child processes ---------------------------------------------------------------------------


def run_child(argv: list[str], env: dict[str, str], server: int | None = None) -> Run:
    """Run argv to completion; wall seconds, CPU seconds and peak RSS come from this one child
    (os.wait4), and the CPU seconds the S3 server (process `server`) spent while it ran."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        server_before = process_cpu(server)
        started = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        server_cpu = process_cpu(server) - server_before
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"`{' '.join(argv)}` exited {proc.returncode}\n{stdout[-2000:]}\n{stderr[-2000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return Run(seconds, usage.ru_maxrss * 1024, stdout, cpu, server_cpu)  # ru_maxrss is KiB on Linux


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds process `pid` has used so far; 0 without one (or off Linux)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in ticks


def last_json(run: Run, argv: list[str]) -> dict:
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise BenchError(f"`{' '.join(argv)}` printed no JSON: {run.stdout[-2000:]}")
    return json.loads(lines[-1])


def tool(name: str) -> str:
    """The tool installed next to this interpreter (same venv as kcache), else the one on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise BenchError(f"`{name}` not found next to {sys.executable} or on PATH (pip install -e '.[bench]')")
    return found


def base_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED}
    env.update(CREDENTIALS, KCACHE_HOME=str(work / "home"))
    return env


# ---- the S3 server -----------------------------------------------------------------------------


def wait_until_up(url: str, proc: subprocess.Popen, tries: int = 150) -> None:
    for _ in range(tries):
        if proc.poll() is not None:
            raise BenchError(f"moto server exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # any HTTP answer means it is serving
        except OSError:
            time.sleep(0.1)
    raise BenchError(f"moto server at {url} did not answer after {tries} tries")


@contextmanager
def moto_server(work: Path, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """A moto S3 server in its own process, so its CPU and GIL are not the client's: (URL, its PID)."""
    port = _procs.free_port()
    url = f"http://127.0.0.1:{port}"
    # Objects over ~5 MiB go to temp files: in the system's temp dir they would put a disk (and its
    # writeback after every upload) into a run whose --scratch took the disk out.
    spool = work / "moto-tmp"
    spool.mkdir()
    env = {**env, "TMPDIR": str(spool)}
    with open(work / "moto.log", "wb") as log:
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            wait_until_up(url, proc)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def s3_client(endpoint: str):
    session = boto3.session.Session(
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )
    return session.client("s3", endpoint_url=endpoint)


def drop_bucket(client, bucket: str) -> None:
    """Empty and delete a repeat's bucket so moto's memory stays flat across repeats (untimed)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


# ---- trees -------------------------------------------------------------------------------------


def text_corpus(rng: random.Random) -> bytes:
    """Kernel-like source lines: repetitive structure with varying numbers, as in Triton/C++ code."""
    ops = ("tl.load", "tl.store", "tl.where", "tl.maximum", "libdevice.exp", "tl.sum")
    lines = []
    for i in range(6000):
        op = rng.choice(ops)
        lines.append(f"    tmp{i % 97} = {op}(in_ptr{rng.randrange(4)} + (x{rng.randrange(3)} + "
                     f"{rng.randrange(4096)}*r0_1), xmask, eviction_policy='evict_last')\n")  # fmt: skip
    return "".join(lines).encode()


def content(rng: random.Random, size: int, corpus: bytes) -> bytes:
    """About half random bytes (like machine code) and half corpus text, in runs of 256 B-2 KiB."""
    parts, total = [], 0
    while total < size:
        run = rng.randrange(256, 2048)
        if rng.random() < 0.5:
            parts.append(rng.randbytes(run))
        else:
            start = rng.randrange(len(corpus) - run)
            parts.append(corpus[start : start + run])
        total += run
    return b"".join(parts)[:size]


def build_synthetic(root: Path, files: int, seed: int) -> None:
    """60% Inductor-like files under inductor/<hh>/, 40% Triton kernel dirs of four files each."""
    rng = random.Random(seed)
    corpus = text_corpus(rng)
    for i in range(files):
        name = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()
        if i % 5 < 3:
            path = root / "inductor" / name[:2] / f"c{name[2:40]}{rng.choice(('.py', '.cpp', '.so', '.json'))}"
        else:
            kernel = hashlib.sha256(f"{seed}-k{i // 4}".encode()).hexdigest()
            path = root / "triton" / kernel / f"triton_poi_fused_{i}{('.cubin', '.json', '.ptx', '.ttir')[i % 4]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content(rng, int(1024 * 16 ** rng.random()), corpus))
    # Compiled wrappers and autotune blobs of several MiB; their count scales with the tree.
    for i in range(max(1, files // 4000)):
        path = root / "inductor" / "aotautograd" / f"large_{i}.so"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content(rng, rng.randrange(4, 12) * 1024 * 1024, corpus))


def build_big(root: Path, files: int, mib: int, seed: int) -> None:
    """`files` files of `mib` MiB: 64 KiB runs, alternately random bytes and kernel-like text."""
    rng = random.Random(seed)
    corpus = text_corpus(rng)
    run = 64 * 1024
    texts = [corpus[i : i + run] for i in range(0, len(corpus) - run, run // 4)]
    (root / "inductor" / "big").mkdir(parents=True)
    for i in range(files):
        with open(root / "inductor" / "big" / f"model-{i:03d}.bin", "wb") as out:
            for j in range(mib * 1024 * 1024 // run):
                out.write(rng.randbytes(run) if j % 2 else rng.choice(texts))


def build_inductor(root: Path, env: dict[str, str], quick: bool) -> str:
    """Compile kcache.torch.workload once with its caches inside ROOT; returns a note, "" on success."""
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
    if probe.returncode != 0:
        return "skipped: torch is not importable"
    (root / "tmp").mkdir(parents=True)
    child = dict(env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"), TMPDIR=str(root / "tmp"))
    argv = [sys.executable, "-m", "kcache.torch.workload", "--json"] + (["--blocks", "1"] if quick else [])
    run = run_child(argv, child)
    return f"workload compiled in {run.seconds:.1f}s"


def prune_to_carried(root: Path) -> dict[str, int]:
    """Delete what publish would not carry (locks, temp files, other TMPDIR debris).

    Then every tool moves exactly the same files, and a restored tree must equal the source.
    """
    carried = {}
    for source, info in publishing.collect(sources.select(), root=root, env=os.environ):
        path = source.restore_dir(root) / info.rel
        carried[path.relative_to(root).as_posix()] = info.size
    for rel in set(listing(root)) - set(carried):
        (root / rel).unlink()
    return carried


def listing(root: Path, skip: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
    found = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel not in skip:
                found[rel] = path.lstat().st_size
    return found


def make_tree(name: str, root: Path, note: str = "") -> Tree:
    carried = prune_to_carried(root)
    rng = random.Random(SEED)
    largest = sorted(carried, key=carried.get)[-5:]  # the streamed path must be checked too
    sample = sorted(set(rng.sample(sorted(carried), min(HASH_SAMPLE, len(carried)))) | set(largest))
    return Tree(name, root, carried, tuple(sample), note)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(tree: Tree, restored: Path, label: str) -> None:
    """Same paths, same sizes, same sampled hashes as the source, or BenchError."""
    got = listing(restored, skip=RESTORE_EXTRAS)
    if got != tree.listing:
        missing = set(tree.listing) - set(got)
        extra = set(got) - set(tree.listing)
        wrong = [p for p in set(got) & set(tree.listing) if got[p] != tree.listing[p]]
        raise BenchError(f"{label}: {len(missing)} missing, {len(extra)} extra, {len(wrong)} wrong-size files "
                         f"(e.g. {sorted(missing | extra)[:3] or wrong[:3]})")  # fmt: skip
    bad = [p for p in tree.sample if sha256(tree.root / p) != sha256(restored / p)]
    if bad:
        raise BenchError(f"{label}: {len(bad)} of {len(tree.sample)} sampled files differ, e.g. {bad[0]}")


# ---- one repeat --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ctx:
    work: Path
    env: dict[str, str]
    endpoint: str
    kcache: str
    aws: str | None
    s5cmd: str | None
    server: int | None = None  # the S3 server's PID, whose CPU each run is charged with
    publish_jobs: int | None = None  # --jobs for every kcache publish; None: publish's default

    def run(self, argv: list[str]) -> Run:
        return run_child(argv, self.env, self.server)

    def discard(self, tree: Path) -> None:
        """Done with a verified tree. One of many files is only moved aside, and deleted once every
        measurement is over: on ext4 without a journal (this VM's disk) the kernel skips inodes freed in
        the last 5-35 s when it creates files, scanning past each, and 20k deleted files made the next
        20k-file restore 3-6x slower (perf: recently_deleted in ext4_create). A measurement must not
        pay for the cleanup of the one before it; a node's fresh emptyDir does not either."""
        if sum(1 for _ in itertools.islice(tree.rglob("*"), SPENT_FILES)) < SPENT_FILES:
            shutil.rmtree(tree)
            return
        spent = self.work / "spent"
        spent.mkdir(exist_ok=True)
        tree.rename(spent / tree.name)  # restore targets are named by tree, operation and repeat


def kcache_run(
    ctx: Ctx, verb: str, tree: Tree, store: str, index: Path | None, target: Path | None = None
) -> tuple[dict, Run]:
    """`kcache publish` or `kcache restore` as a child; `index` None restores through the store's refs/."""
    # --strict: kcache restore is fail-open, and a cold start must not be timed as a fast restore.
    if verb == "publish":
        where = ["--from", str(tree.root), *(["--jobs", str(ctx.publish_jobs)] if ctx.publish_jobs else [])]
    else:
        where = ["--into", str(target), "--strict", "--timeout", "3600"]
    argv = [ctx.kcache, verb, *where, "--store", store, "--index", f"sqlite:///{index}" if index else "none",
            "--s3-endpoint-url", ctx.endpoint, "--model", f"bench-{tree.name}", "--json"]  # fmt: skip
    run = ctx.run(argv)
    return last_json(run, argv), run


def sample(run: Run, **extra) -> dict:
    return {"seconds": run.seconds, "maxrss": run.maxrss, "cpu": run.cpu, "server_cpu": run.server_cpu, **extra}


def kcache_s3(ctx: Ctx, tree: Tree, bucket: str, n: int) -> dict[str, dict]:
    """First publish into an empty bucket, republish unchanged, restore into a fresh dir."""
    store, index = f"s3://{bucket}/kcache", ctx.work / "files" / f"{tree.name}-s3-{n}.db"
    first, run1 = kcache_run(ctx, "publish", tree, store, index)
    again, run2 = kcache_run(ctx, "publish", tree, store, index)
    restored = {}
    # "restore" is what the example init container runs (examples/k8s/deployment.yaml: KCACHE_INDEX=none,
    # the newest bundle from refs/); "restore-index" finds it through the SQLite index instead, which
    # adds SQLAlchemy's import (~0.3 s here) and the index's queries. Each goes first in every other
    # repeat: the second writes into the pages the first one's discarded output freed (see one_repeat).
    ways = (("restore", None), ("restore-index", index))
    for op, through in ways if n % 2 == 0 else ways[::-1]:
        target = ctx.work / "out" / f"{tree.name}-{op}-{n}"
        got, run = kcache_run(ctx, "restore", tree, store, through, target)
        if got.get("status") != "hit" or got.get("files") != len(tree.listing):
            raise BenchError(f"{tree.name}: {op} said {got}")
        verify(tree, target, f"{tree.name} kcache {op} (s3)")
        ctx.discard(target)
        restored[op] = sample(run, inside=got["seconds"])  # the restore's own work, start-up left out
    return {"publish": sample(run1, uploaded_bytes=first["uploaded_bytes"], packs=first["packs"]),
            "republish": sample(run2, uploaded_bytes=again["uploaded_bytes"], new_blobs=again["new_blobs"]),
            **restored}  # fmt: skip


def aws_sync(ctx: Ctx, tree: Tree, bucket: str, n: int) -> dict[str, dict]:
    remote = f"s3://{bucket}/sync/"
    common = ["--endpoint-url", ctx.endpoint, "--only-show-errors"]
    up = ctx.run([ctx.aws, "s3", "sync", str(tree.root), remote, *common])
    target = ctx.work / "out" / f"{tree.name}-sync-{n}"
    down = ctx.run([ctx.aws, "s3", "sync", remote, str(target), *common])
    verify(tree, target, f"{tree.name} aws s3 sync down")
    ctx.discard(target)
    return {"sync-up": sample(up), "sync-down": sample(down)}


def s5cmd(ctx: Ctx, tree: Tree, bucket: str, n: int) -> dict[str, dict]:
    remote = f"s3://{bucket}/s5/"
    common = [ctx.s5cmd, "--endpoint-url", ctx.endpoint, "--log", "error"]
    up = ctx.run([*common, "cp", f"{tree.root}/", remote])
    target = ctx.work / "out" / f"{tree.name}-s5cmd-{n}"
    down = ctx.run([*common, "cp", remote + "*", f"{target}/"])
    verify(tree, target, f"{tree.name} s5cmd cp down")
    ctx.discard(target)
    return {"s5cmd-up": sample(up), "s5cmd-down": sample(down)}


def tar_zstd(ctx: Ctx, tree: Tree, n: int) -> dict[str, dict]:
    archive = ctx.work / "files" / f"{tree.name}-{n}.tar.zst"
    target = ctx.work / "out" / f"{tree.name}-tar-{n}"
    target.mkdir(parents=True)
    shell = ["bash", "-o", "pipefail", "-c"]
    create = ctx.run(shell + [f"tar -C '{tree.root}' -cf - . | zstd -T0 -q -o '{archive}'"])
    extract = ctx.run(shell + [f"zstd -dc '{archive}' | tar -C '{target}' -xf -"])
    verify(tree, target, f"{tree.name} tar|zstd extract")
    ctx.discard(target)
    packed = archive.stat().st_size
    archive.unlink()
    return {"tar-create": sample(create, archive_bytes=packed), "tar-extract": sample(extract)}


def kcache_file(ctx: Ctx, tree: Tree, n: int) -> dict[str, dict]:
    """kcache against a local file:// store: the same disk as the tar|zstd floor."""
    store_dir = ctx.work / "files" / f"{tree.name}-store-{n}"
    index = ctx.work / "files" / f"{tree.name}-file-{n}.db"
    _, pub = kcache_run(ctx, "publish", tree, f"file://{store_dir}", index)
    target = ctx.work / "out" / f"{tree.name}-restore-file-{n}"
    _, run = kcache_run(ctx, "restore", tree, f"file://{store_dir}", index, target)
    verify(tree, target, f"{tree.name} kcache restore (file)")
    ctx.discard(target)
    shutil.rmtree(store_dir)
    return {"publish-file": sample(pub), "restore-file": sample(run)}


def one_repeat(ctx: Ctx, tree: Tree, n: int) -> dict[str, dict]:
    client = s3_client(ctx.endpoint)
    bucket = f"bench-{tree.name}-{n}"
    client.create_bucket(Bucket=bucket)
    try:
        # Each tool goes first in every other repeat: in a sandbox, writing a GiB into pages the kernel
        # must find anew cost 2.9 CPU-s where pages just freed by the last tool's output cost 0.37 s,
        # so a fixed order measured the order as much as the tools.
        steps = [partial(kcache_s3, ctx, tree, bucket, n)]
        steps += [partial(s5cmd, ctx, tree, bucket, n)] if ctx.s5cmd else []
        steps += [partial(aws_sync, ctx, tree, bucket, n)] if ctx.aws else []
        found: dict[str, dict] = {}
        for step in steps if n % 2 == 0 else steps[::-1]:
            found.update(step())
    finally:
        drop_bucket(client, bucket)
    found.update(tar_zstd(ctx, tree, n))
    found.update(kcache_file(ctx, tree, n))
    return found


def measure(ctx: Ctx, tree: Tree, repeats: int, step) -> dict[str, list[dict]]:
    """`step(ctx, tree, n)` once per repeat; its samples gathered per operation."""
    samples: dict[str, list[dict]] = {}
    for n in range(repeats):
        started = time.perf_counter()
        for op, found in step(ctx, tree, n).items():
            samples.setdefault(op, []).append(found)
        print(f"bench: {tree.name} repeat {n + 1}/{repeats} done in {time.perf_counter() - started:.1f}s",
              file=sys.stderr)  # fmt: skip
    return samples


def rss_repeat(ctx: Ctx, tree: Tree, n: int) -> dict[str, dict]:
    """Only publish and restore: the smaller tree exists to compare restore's peak memory."""
    client = s3_client(ctx.endpoint)
    bucket = f"bench-{tree.name}-{n}"
    client.create_bucket(Bucket=bucket)
    try:
        found = kcache_s3(ctx, tree, bucket, n)
    finally:
        drop_bucket(client, bucket)
    return found


# ---- report ------------------------------------------------------------------------------------


def median(samples: list[dict], key: str = "seconds") -> float:
    return statistics.median(s[key] for s in samples)


def shape(tree: Tree) -> str:
    """"small" for a tree of small files (see SMALL_FILE_BYTES), else "big"."""
    return "small" if sum(tree.listing.values()) < SMALL_FILE_BYTES * max(1, len(tree.listing)) else "big"


def ratios(results: dict[str, dict[str, list[dict]]], trees: dict[str, Tree]) -> list[dict]:
    rows = []
    for tree, ops in results.items():
        if "republish" not in ops or "tar-extract" not in ops:
            continue  # the quarter-size tree: only there for restore's peak memory
        for shapes, label, num, den, bound, kind in TARGETS:
            if shape(trees[tree]) not in shapes or num not in ops or den not in ops:
                continue
            value = median(ops[num]) / median(ops[den])
            ok = value >= bound if kind == "min" else value <= bound
            target = f"{'>=' if kind == 'min' else '<='} {bound:g}"
            rows.append({"tree": tree, "shape": shape(trees[tree]), "ratio": label, "value": value, "target": target,
                         "ok": ok})  # fmt: skip
        uploaded = max(s["uploaded_bytes"] for s in ops["republish"])
        rows.append({"tree": tree, "shape": shape(trees[tree]), "ratio": "republish uploaded bytes", "value": uploaded,
                     "target": "== 0", "ok": uploaded == 0})  # fmt: skip
    return rows


def print_report(trees: dict[str, Tree], results: dict, rows: list[dict], rss: dict) -> None:
    # CPU s: the command's own user + system seconds; server CPU s: the S3 server's meanwhile. On a
    # machine with fewer cores than the work can use, their sum over the core count bounds the wall time.
    print(f"{'tree':<18} {'files':>6} {'MB':>7}  {'operation':<13} {'median s':>9} {'min s':>8} {'max s':>8} "
          f"{'MB/s':>7} {'CPU s':>6} {'server CPU s':>12} {'peak RSS MiB':>12}")  # fmt: skip
    for name, ops in results.items():
        tree = trees[name]
        size = sum(tree.listing.values()) / 1e6
        for op, samples in ops.items():
            rss_mib = max(s["maxrss"] for s in samples) / 2**20
            secs = [s["seconds"] for s in samples]
            rate = size / median(samples)
            print(f"{name:<18} {len(tree.listing):>6} {size:>7.1f}  {op:<13} {median(samples):>9.3f} "
                  f"{min(secs):>8.3f} {max(secs):>8.3f} {rate:>7.0f} {median(samples, 'cpu'):>6.2f} "
                  f"{median(samples, 'server_cpu'):>12.2f} {rss_mib:>12.0f}")  # fmt: skip
    print(f"cores this process may use: {len(os.sched_getaffinity(0))}")
    for name, ops in results.items():  # what a restore costs whatever the bundle: start-up, not the data
        for op in ("restore", "restore-index"):
            if op in ops:
                whole, inside = median(ops[op]), median(ops[op], "inside")
                print(f"{name:<18} {op:<13} {whole:.3f} s: restore's own work {inside:.3f} s, start-up and "
                      f"exit {whole - inside:.3f} s")  # fmt: skip
    print()
    for row in rows:
        value = f"{row['value']:.3f}" if isinstance(row["value"], float) else str(row["value"])
        verdict = "ok" if row["ok"] else "MISSED"
        name = f"{row['tree']} ({row['shape']})"
        print(f"{name:<26} {row['ratio']:<40} {value:>10}  target {row['target']:<7} {verdict}")
    print()
    for name, peak in rss.items():
        tree = trees[name]
        print(f"restore peak RSS  {name:<18} {len(tree.listing):>6} files {sum(tree.listing.values()) / 1e6:>7.1f} MB  "
              f"{peak / 2**20:>6.0f} MiB")  # fmt: skip
    if {"synthetic", "synthetic-quarter"} <= set(rss):
        print(f"restore peak RSS  synthetic / synthetic-quarter = {rss['synthetic'] / rss['synthetic-quarter']:.2f} "
              "(flat means memory does not grow with the bundle)")  # fmt: skip
    for name, tree in trees.items():
        if tree.note:
            print(f"note: {name}: {tree.note}")


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--files", type=int, default=20000, help="small files in the synthetic tree (default 20000)")
    parser.add_argument("--repeats", type=int, default=3, help="samples per operation, medians reported (default 3)")
    parser.add_argument("--big-files", type=int, default=64, help="files in the big tree (default 64)")
    parser.add_argument("--big-mib", type=int, default=16, help="MiB per file in the big tree (default 16)")
    parser.add_argument(
        "--shapes",
        default="synthetic,big,inductor",
        help="trees to run, comma-separated (default synthetic,big,inductor)",
    )
    parser.add_argument(
        "--baselines", default="s5cmd,aws", help="S3 tools to compare with, comma-separated: s5cmd, aws (default both)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a fast check: 2000 files, a 4 x 16 MiB big tree, 1 repeat, a 1-block workload",
    )
    parser.add_argument("--no-inductor", action="store_true", help="skip the real Inductor tree")
    parser.add_argument("--publish-jobs", type=int, metavar="N",
                        help="pass --jobs N to every kcache publish (default: publish's own default)")  # fmt: skip
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="print one JSON object instead of the table; with PATH, write it there and "
                             "print the table too")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory and print its path")
    parser.add_argument("--scratch", metavar="DIR",
                        help="where trees, stores and restore targets live (default the temp dir); /dev/shm "
                             "takes the disk out of the comparison, as an emptyDir with medium Memory does")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.files, args.repeats, args.big_files = 2000, 1, 4
    args.shapes = set(args.shapes.split(","))
    args.baselines = set(args.baselines.split(","))
    if args.no_inductor:
        args.shapes.discard("inductor")
    return args


def check_tools(baselines: set[str]) -> dict[str, str | None]:
    missing = [t for t in ("tar", "zstd", "bash") if shutil.which(t) is None]
    if missing:
        raise BenchError(f"missing {', '.join(missing)}: apt-get install {' '.join(missing)}")
    return {"kcache": tool("kcache"), "aws": tool("aws") if "aws" in baselines else None,
            "s5cmd": tool("s5cmd") if "s5cmd" in baselines else None}  # fmt: skip


def build_trees(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Tree]:
    trees = {}
    if "synthetic" in args.shapes:
        for name, files in (("synthetic", args.files), ("synthetic-quarter", max(1, args.files // 4))):
            root = work / "trees" / name
            build_synthetic(root, files, SEED + files)
            trees[name] = make_tree(name, root)
    if "big" in args.shapes:
        build_big(work / "trees" / "big", args.big_files, args.big_mib, SEED)
        trees["big"] = make_tree("big", work / "trees" / "big")
    if "inductor" in args.shapes:
        root = work / "trees" / "inductor"
        note = build_inductor(root, env, args.quick)
        if (root / "inductor").is_dir():
            trees["inductor"] = make_tree("inductor", root, note)
        else:
            print(f"bench: inductor tree {note}", file=sys.stderr)
    return trees


def run_all(args: argparse.Namespace, work: Path, tools: dict[str, str]) -> dict:
    env = base_env(work)
    (work / "files").mkdir(parents=True)
    trees = build_trees(args, work, env)
    with moto_server(work, env) as (endpoint, server):
        ctx = Ctx(work, env, endpoint, tools["kcache"], tools["aws"], tools["s5cmd"], server, args.publish_jobs)
        results = {}
        for name, tree in trees.items():
            step = rss_repeat if name == "synthetic-quarter" else one_repeat
            results[name] = measure(ctx, tree, args.repeats, step)
    shutil.rmtree(work / "spent", ignore_errors=True)
    rss = {name: max(s["maxrss"] for s in results[name]["restore"]) for name in results}
    return {"trees": trees, "results": results, "ratios": ratios(results, trees), "rss": rss}


def write_json(args: argparse.Namespace, tools: dict[str, str], out: dict) -> None:
    trees = {n: {"files": len(t.listing), "bytes": sum(t.listing.values()), "note": t.note}
             for n, t in out["trees"].items()}  # fmt: skip
    plain_args = {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()}
    text = json.dumps({"args": plain_args, "tools": tools, "trees": trees, "results": out["results"],
                       "cores": len(os.sched_getaffinity(0)),
                       "ratios": out["ratios"], "restore_peak_rss": out["rss"]}, sort_keys=True)  # fmt: skip
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tools = check_tools(args.baselines)
    _procs.compile_kcache()
    work = Path(tempfile.mkdtemp(prefix="kcache-bench-store-", dir=args.scratch))
    try:
        out = run_all(args, work, tools)
    except BenchError as exc:
        print(f"bench: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"bench: scratch kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        write_json(args, tools, out)
    if args.json != "-":
        print_report(out["trees"], out["results"], out["ratios"], out["rss"])
    return 0 if all(r["ok"] for r in out["ratios"]) else 2


if __name__ == "__main__":
    sys.exit(main())
