"""Restore's memory stays bounded whatever the bundle holds: a file that compresses to almost
nothing is streamed to disk, never decompressed whole in memory.

The bound is measured on a real `kcache restore` child process (its peak RSS), so it covers
everything restore does, not one function.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache import limits, packs, refs
from kcache import manifest as manifests
from kcache.cli import main
from kcache.store import manifest_key, open_store, pack_key

MiB = 1024 * 1024
ZEROS = 300 * MiB  # zstd turns this into a few KiB: one small range read, one huge blob
PEAK_RSS_LIMIT = 150 * MiB  # measured 33 MiB; 329 MiB when the file was decompressed in memory
RESTORE_RSS_BOUND = 256 * MiB  # the bound restore keeps for any bundle (issue 11)


# The restore runs under a small launcher that reports its only child's peak RSS: a child forked
# straight from pytest would count pytest's own pages, which it shares until it execs.
LAUNCHER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def restore_peak_rss(*args: str) -> tuple[int, int, str]:
    """Run `kcache restore` as a child; (exit code, peak RSS in bytes, stderr)."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "kcache", "restore", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    return proc.returncode, int(proc.stdout.split()[-1]) * 1024, proc.stderr  # ru_maxrss is in KiB on Linux


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


def published_then_restored(tmp_path, src, *extra: str) -> tuple[Path, int]:
    """Publish `src` to a file:// store, restore it in a child process; (the root, its peak RSS)."""
    store = f"file://{tmp_path / 'store'}"
    published = CliRunner().invoke(main, ["publish", "--from", str(src), "--model", "m", "--store", store],
                                   catch_exceptions=False)  # fmt: skip
    assert published.exit_code == 0, published.output
    dest = tmp_path / "dest"
    code, peak, stderr = restore_peak_rss("--into", str(dest), "--model", "m", "--store", store, "--index", "none",
                                          "--strict", *extra)  # fmt: skip
    assert code == 0, stderr
    return dest, peak


def test_a_huge_compressible_file_is_restored_in_bounded_memory(tmp_path):
    src = tmp_path / "src"
    big = src / "vllm/torch_compile_cache/h/rank_0_0/zeros.bin"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(ZEROS)  # sparse: reads as zeros without taking the disk
    dest, peak = published_then_restored(tmp_path, src)
    assert sum(p.stat().st_size for p in (tmp_path / "store/packs").rglob("*") if p.is_file()) < MiB
    restored = dest / "vllm/torch_compile_cache/h/rank_0_0/zeros.bin"
    assert restored.stat().st_size == ZEROS
    assert sha256_file(restored) == sha256_file(big)
    assert peak < PEAK_RSS_LIMIT, f"restore peaked at {peak / MiB:.0f} MiB"


def test_a_large_random_file_fetched_in_parallel_parts_stays_within_the_restore_bound(tmp_path):
    """96 MiB that do not compress: six parts on sixteen threads, each holding at most a MiB or two."""
    src = tmp_path / "src"
    big = src / "vllm/torch_compile_cache/h/rank_0_0/weights.bin"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        for _ in range(12):
            f.write(os.urandom(8 * MiB))
    dest, peak = published_then_restored(tmp_path, src, "--jobs", "16")
    assert sha256_file(dest / "vllm/torch_compile_cache/h/rank_0_0/weights.bin") == sha256_file(big)
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"


def _published_small(tmp_path, url: str, *s3: str):
    """(store, manifest) of a one-file bundle published to `url` (`*s3`: --s3-endpoint-url and its value)."""
    write_tree(tmp_path / "src", {"inductor/fx/a.py": b"a"})
    argv = ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--store", url, *s3, "--json"]
    published = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert published.exit_code == 0, published.output
    store = open_store(url, endpoint_url=s3[1]) if s3 else open_store(url)
    return store, manifests.fetch(store, json.loads(published.output.splitlines()[-1])["bundle_id"])


def _manifest_at_the_cap(published: manifests.Manifest, cap: int, packs: str = "one") -> manifests.Manifest:
    """As many compact entries as fit under `cap` bytes, in one pack no store holds, or (packs="each")
    each in a pack of its own."""
    absent = hashlib.sha256(b"no such pack").hexdigest()
    widest = ["inductor/fx/00/k0000000.py", 420, 1999, "0" * 64, absent, 9_999_999 * 900, 900, 2**60 + 9_999_999]
    count = (cap - 4096) // (len(json.dumps(widest, separators=(",", ":"))) + 1)

    def pack(i: int) -> str:
        return absent if packs == "one" else hashlib.sha256(b"pack %d" % i).hexdigest()

    entries = [manifests.Entry(f"inductor/fx/{i % 100:02d}/k{i:07d}.py", 0o644, 1000 + i % 1000,
                               hashlib.sha256(i.to_bytes(4, "big")).hexdigest(), pack(i), i * 900, 900, 2**60 + i)
               for i in range(count)]  # fmt: skip
    return manifests.build(published.bundle_key, published.toolchain_key, published.workload_key, published.facts,
                           published.layers, entries)  # fmt: skip


@pytest.mark.parametrize("packs", ["one", "each"])
def test_a_manifest_at_the_default_cap_is_parsed_within_the_restore_bound(tmp_path, s3_bucket, packs):
    """The manifest cap is what bounds restore's memory for any bundle, a hostile store's included: one
    just under the default cap is read from S3 (boto3 and all), verified and planned, and the
    process stays under the bound. Also when every file names a pack of its own (~160k reads to
    plan): a closure per read had taken restore to ~340 MiB."""
    url, endpoint = s3_bucket
    store, small = _published_small(tmp_path, url, "--s3-endpoint-url", endpoint)
    big = _manifest_at_the_cap(small, limits.max_manifest_bytes(), packs)
    data = big.to_bytes()
    assert 0.95 * limits.max_manifest_bytes() < len(data) <= limits.max_manifest_bytes()
    (tmp_path / "big.json").write_bytes(data)
    store.put_file(manifest_key(big.id), tmp_path / "big.json")
    refs.advance(store, refs.Ref(small.bundle_key, big.id, datetime.now(timezone.utc) + timedelta(hours=1)))
    del big, data, small

    code, peak, stderr = restore_peak_rss("--into", str(tmp_path / "dest"), "--model", "m", "--store", url,
                                          "--s3-endpoint-url", endpoint, "--index", "none", "--strict")  # fmt: skip
    assert code != 0
    assert "pack" in stderr and "too large" not in stderr, stderr  # parsed and planned; it stopped at the pack
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"


@pytest.mark.parametrize(("content", "window_log"), [(4 * MiB - 4096, 21), (9 * MiB, 23)],
                         ids=["in-memory", "streamed"])  # fmt: skip
def test_sixteen_fetch_threads_beside_a_manifest_at_the_cap_stay_within_the_restore_bound(tmp_path, content,
                                                                                          window_log):  # fmt: skip
    """A manifest at the cap whose first reads are 16 blobs of 4 MiB (read and decompressed in memory) or of
    9 MiB framed with an 8 MiB window (streamed), on 16 fetch threads: each thread's glibc arena kept the
    largest buffers it had held and each decoder its window, ~300 MiB (in-memory) and ~360 MiB (streamed)."""
    import zstandard

    store_url = f"file://{tmp_path / 'store'}"
    store, small = _published_small(tmp_path, store_url)
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log, write_content_size=True)
    big = []
    for k in range(16):
        data = os.urandom(content)
        frame = zstandard.ZstdCompressor(compression_params=params).compress(data)
        pack = frame + packs.trailer([packs.PackedBlob(hashlib.sha256(data).hexdigest(), 0, len(frame), len(data))])
        store.put_bytes(pack_key(hashlib.sha256(pack).hexdigest()), pack)
        big.append(manifests.Entry(f"inductor/big/{k:02d}", 0o644, len(data), hashlib.sha256(data).hexdigest(),
                                   hashlib.sha256(pack).hexdigest(), 0, len(frame), 0))  # fmt: skip
    capped = _manifest_at_the_cap(small, limits.max_manifest_bytes() - 16 * 300, "each")  # packs no store holds
    manifest = manifests.build(small.bundle_key, small.toolchain_key, small.workload_key, small.facts, small.layers,
                               [*capped.entries, *big])  # fmt: skip
    store.put_bytes(manifest_key(manifest.id), manifest.to_bytes())
    refs.advance(store, refs.Ref(small.bundle_key, manifest.id, datetime.now(timezone.utc) + timedelta(hours=1)))
    del manifest, capped, small, big, data, frame, pack

    code, peak, stderr = restore_peak_rss("--into", str(tmp_path / "dest"), "--model", "m", "--store", store_url,
                                          "--index", "none", "--strict", "--jobs", "16")  # fmt: skip
    assert code != 0 and "pack" in stderr, stderr  # the big blobs were read first, then a missing pack stopped it
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"


def test_a_manifest_at_the_cap_with_one_wide_character_is_refused_before_it_is_decoded(tmp_path):
    """One emoji in one path of a manifest just under the cap: json.loads decodes the whole document
    into one string, 4 bytes a character once any character needs them (128 MiB for 32 MiB of bytes):
    restore peaked at ~316 MiB from a file:// store. The decoded text counts against the cap."""
    store_url = f"file://{tmp_path / 'store'}"
    store, small = _published_small(tmp_path, store_url)
    big = _manifest_at_the_cap(small, limits.max_manifest_bytes())
    wide = manifests.Entry("inductor/fx/\U0001f600.py", 0o644, 1, hashlib.sha256(b"wide").hexdigest(),
                           big.entries[0].pack, 0, 1, 0)  # fmt: skip
    big = manifests.build(big.bundle_key, big.toolchain_key, big.workload_key, big.facts, big.layers,
                          [wide, *big.entries[1:]])  # fmt: skip
    data = big.to_bytes()
    assert 0.95 * limits.max_manifest_bytes() < len(data) <= limits.max_manifest_bytes()
    store.put_bytes(manifest_key(big.id), data)
    refs.advance(store, refs.Ref(small.bundle_key, big.id, datetime.now(timezone.utc) + timedelta(hours=1)))
    del big, data, small

    code, peak, stderr = restore_peak_rss("--into", str(tmp_path / "dest"), "--model", "m", "--store", store_url,
                                          "--index", "none", "--strict")  # fmt: skip
    assert code != 0
    assert "bytes of text" in stderr, stderr
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"


def test_a_seek_table_as_long_as_the_manifest_cap_allows_stays_within_the_restore_bound(tmp_path):
    """A store writer's manifest at the cap that is one blob's chunk digests (~500k, one per 4 MiB of a
    2 TB file), and a pack whose seek table names as many one-byte frames: the table adds up, so the
    blob is split. An object per frame had taken restore to ~300 MiB; the table is kept as arrays."""
    store_url = f"file://{tmp_path / 'store'}"
    store, small = _published_small(tmp_path, store_url)
    count = (limits.max_manifest_bytes() - 4096 - len(small.to_bytes())) // 67  # a digest: 64 hex, quotes, comma
    table = packs.seek_table([(1, packs.CHUNK_BYTES)] * count)
    body = bytes(count) + table  # frames of one byte each: no zstd frame, but only the read finds that
    size = count * packs.CHUNK_BYTES
    pack = body + packs.trailer([packs.PackedBlob("0" * 64, 0, len(body), size)])
    pack_id = hashlib.sha256(pack).hexdigest()
    store.put_bytes(pack_key(pack_id), pack)
    blob = hashlib.sha256(b"a file of 2 TB").hexdigest()
    digests = [hashlib.sha256(i.to_bytes(4, "big")).hexdigest() for i in range(count)]
    entry = manifests.Entry("inductor/fx/huge.bin", 0o644, size, blob, pack_id, 0, len(body), 0)
    big = manifests.build(small.bundle_key, small.toolchain_key, small.workload_key, small.facts, small.layers,
                          [entry], small.layer_info, {blob: digests})  # fmt: skip
    data = big.to_bytes()
    assert 0.95 * limits.max_manifest_bytes() < len(data) <= limits.max_manifest_bytes()
    store.put_bytes(manifest_key(big.id), data)
    refs.advance(store, refs.Ref(small.bundle_key, big.id, datetime.now(timezone.utc) + timedelta(hours=1)))
    del big, data, digests, small, pack, body, table

    code, peak, stderr = restore_peak_rss("--into", str(tmp_path / "dest"), "--model", "m", "--store", store_url,
                                          "--index", "none", "--strict")  # fmt: skip
    assert code != 0
    assert "not a valid zstd frame" in stderr, stderr  # the table was taken and the parts read
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"


def _zeros_table(tokens: int) -> bytes:
    """A vLLM table of `tokens` Python tokens, nearly all `0` and `,`: the most AST per byte."""
    return b'{"k": [' + b"0," * ((tokens - 8) // 2) + b"]}"  # 8: { "k" : [ ] } NEWLINE ENDMARKER


@pytest.mark.parametrize("case", ["at-the-byte-cap", "at-the-token-cap", "at-the-token-cap-moved"])
def test_a_vllm_index_of_tiny_literals_stays_within_the_restore_bound(tmp_path, case):
    """A vllm_compile_cache.py just under relocate's byte cap holding millions of `0,` compresses to
    a few KiB; parsed into an AST it took restore to ~2 GiB. It is dropped unparsed instead, and the
    largest table still parsed keeps restore well under its bound."""
    from kcache import relocate

    rank = "vllm/torch_compile_cache/h/rank_0_0"
    if case == "at-the-byte-cap":
        table = b'{"k": [' + b"0," * (relocate._MAX_INDEX_BYTES // 2 - 8) + b"]}"
    elif case == "at-the-token-cap":
        table = _zeros_table(relocate._MAX_TABLE_TOKENS)
    else:  # a handle to move as well: the rewritten table is parsed again, to know vLLM can read it
        handle = f'"h": ("a", "/pub/{rank.removeprefix("vllm/")}/artifact"), '.encode()
        table = b"{" + handle + b'"k": [' + b"0," * ((relocate._MAX_TABLE_TOKENS - 16) // 2) + b"]}"
    assert len(table) <= relocate._MAX_INDEX_BYTES
    src = tmp_path / "src"
    write_tree(src, {f"{rank}/vllm_compile_cache.py": table, f"{rank}/artifact": b"kept"})
    dest, peak = published_then_restored(tmp_path, src)
    # Refused: the engine rebuilds it. At the cap: parsed, nothing to move, kept as published.
    assert (dest / rank / "vllm_compile_cache.py").exists() == case.startswith("at-the-token-cap")
    if case == "at-the-token-cap-moved":
        import ast

        moved = ast.literal_eval((dest / rank / "vllm_compile_cache.py").read_text())
        assert moved["h"][1] == str(dest / rank / "artifact")
    assert (dest / rank / "artifact").read_bytes() == b"kept"
    assert peak < PEAK_RSS_LIMIT, f"restore peaked at {peak / MiB:.0f} MiB"


def _ninja_folder_at_the_caps() -> dict[str, bytes]:
    """A load_inline build folder whose three files sit at relocation's caps, each shaped for the most
    memory per byte: values of 4-byte characters evaluated up to the folder's budget, a log of the
    shortest entries and a deps log of the shortest path records. They compress to almost nothing."""
    from kcache import ninjabuild

    wide = "\U0001f600" * 200_000
    # as many copies of b (1M characters) as leave both parses (as published, as moved) inside the budget
    copies = (ninjabuild.MAX_EVALUATED_CHARS // 2 - 1_300_000) // 1_000_001
    rule = ["rule cc", "  command = g++ $in -o $out", "build main.o: cc /pub/ext/main.cpp", ""]
    manifest = "\n".join(["a = " + wide, "b = $a$a$a$a$a", *(f"c{i} = $b." for i in range(copies)), *rule])
    entry = b"0\t0\t0\tx\t0\n"
    log = b"# ninja log v5\n" + entry * ((ninjabuild.MAX_LOG_BYTES - 16) // len(entry))
    head = b"# ninjadeps\n" + struct.pack("<i", 4)
    count = (ninjabuild.MAX_DEPS_BYTES - len(head)) // 12
    records = b"".join(struct.pack("<I4sI", 8, b"/p", ~i & 0xFFFFFFFF) for i in range(count))
    return {"torch_extensions/ext/build.ninja": manifest.encode(), "torch_extensions/ext/main.cpp": b"int x;",
            "torch_extensions/ext/.ninja_log": log, "torch_extensions/ext/.ninja_deps": head + records}  # fmt: skip


def test_a_ninja_build_folder_at_relocations_caps_stays_within_the_restore_bound(tmp_path):
    """Restore rewrites a load_inline build folder for its new ROOT: a 16 MiB deps log of 12-byte records
    and a 4 MiB log held as one Python object per record and line, with a build.ninja evaluated to 32 Mi
    characters of 4 bytes each, took restore to ~360 MiB from a bundle of a few KiB."""
    write_tree(tmp_path / "src", _ninja_folder_at_the_caps())
    dest, peak = published_then_restored(tmp_path, tmp_path / "src")
    assert str(dest / "torch_extensions/ext/main.cpp") in (dest / "torch_extensions/ext/build.ninja").read_text()
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"
