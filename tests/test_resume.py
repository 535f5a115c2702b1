"""A range read cut mid-body resumes where it stopped: one dropped connection must not turn a restore cold.

botocore retries requests, not bodies. A real moto server sits behind a TCP proxy that resets the
connection once a ranged GET has delivered a given number of bytes (tests/cutting_proxy.py).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from click.testing import CliRunner
from cutting_proxy import CuttingProxy
from faulty import raising
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import read_tree, write_tree

from kcache import fetch, streams
from kcache import manifest as manifests
from kcache.cli import main
from kcache.errors import StoreError
from kcache.restore import read_state
from kcache.store import manifest_key, open_store

MiB = 1024 * 1024
MODEL = "resume-model"
# One pack, read with one ranged GET: a blob read into memory, then one streamed to disk.
FILES = {"inductor/fx/small": os.urandom(3 * MiB), "triton/k/big.cubin": os.urandom(6 * MiB)}


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def s3_bundle(tmp_path, s3_bucket):
    url, endpoint = s3_bucket
    write_tree(tmp_path / "src", FILES)
    published = cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url,
                    "--s3-endpoint-url", endpoint, "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    assert published.exit_code == 0, published.output
    return url, endpoint


def restore_through(proxy: CuttingProxy, url: str, root, *extra):
    return cli("restore", "--into", root, "--model", MODEL, "--store", url, "--s3-endpoint-url", proxy.url,
               "--index", "none", "--jobs", "1", "--json", *extra)  # fmt: skip


@pytest.mark.parametrize("after", [1 * MiB, 5 * MiB], ids=["in-memory-blob", "streamed-blob"])
def test_a_connection_cut_mid_body_resumes_and_hits(tmp_path, s3_bundle, after):
    url, endpoint = s3_bundle
    root = tmp_path / "dst"
    with CuttingProxy(endpoint, after=after, cuts=1) as proxy:
        result = restore_through(proxy, url, root, "--strict")
        assert proxy.cut == 1  # the fault really happened
        assert proxy.ranged_gets == 2  # the read, and one resume for the rest
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads(result.stdout)["status"] == "hit"
    assert read_tree(root / "inductor") == {"fx/small": (FILES["inductor/fx/small"], 0o644)}
    assert read_tree(root / "triton") == {"k/big.cubin": (FILES["triton/k/big.cubin"], 0o644)}


def test_a_connection_cut_every_time_gives_up_after_bounded_resumes(tmp_path, s3_bundle):
    url, endpoint = s3_bundle
    root = tmp_path / "dst"
    with CuttingProxy(endpoint, after=MiB, cuts=1000) as proxy:
        result = restore_through(proxy, url, root)
        cuts, gets = proxy.cut, proxy.ranged_gets
    assert result.exit_code == 0  # fail-open: the pod starts cold
    assert read_state(root)["status"] == "error"
    assert cuts == gets == 1 + streams.RESUMES  # each resume was cut again; then it stopped


def test_resumed_reads_ask_only_for_the_rest(tmp_path, s3_bundle):
    """The resume is a ranged GET from where the body stopped, not the whole range again."""
    url, endpoint = s3_bundle
    store = open_store(url, endpoint_url=endpoint)
    (info,) = list(store.list("manifests"))
    bundle_id = info.key.rsplit("/", 1)[1]
    entries = manifests.parse(store.get_bytes(manifest_key(bundle_id)), bundle_id).entries
    (rng,) = fetch.plan_ranges(entries)
    opened = []

    class Recording:
        url = store.url

        def open_range(self, key, offset, length):
            opened.append((offset, length))
            return store.open_range(key, offset, length)

    got = {}
    damaged = raising(Recording(), lambda: StoreError(store.url, "connection reset (injected)"))
    # `raising` fails every read once half of it has arrived: each resume asks for half as much.
    with pytest.raises(StoreError, match="connection reset"):
        fetch.read_range(damaged, rng, lambda e, frame: got.setdefault(e.path, _consume(frame)), lambda: False)
    starts = [offset for offset, _ in opened]
    assert len(opened) == 1 + streams.RESUMES and starts == sorted(set(starts))
    for (offset, length), (next_offset, next_length) in zip(opened, opened[1:]):
        assert next_offset + next_length == offset + length == rng.end and next_offset > offset


def test_no_resume_once_the_caller_cancelled(tmp_path, store, sqlite_index, fp):
    from kcache import sources
    from kcache.publish import publish

    write_tree(tmp_path / "src", {"cuda/a": os.urandom(100_000)})
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src")
    entries = manifests.parse(store.get_bytes(manifest_key(result.bundle_id)), result.bundle_id).entries
    failed = []

    def reset() -> StoreError:
        failed.append(True)
        return StoreError(store.url, "connection reset (injected)")

    damaged = raising(store, reset)
    with pytest.raises(StoreError, match="connection reset"):
        fetch.read_range(damaged, fetch.plan_ranges(entries)[0], lambda e, f: _consume(f), lambda: bool(failed))
    assert failed and damaged.reads == 1  # the budget ran out: the failure is reported, not retried


def _consume(frame) -> str:
    data = frame if isinstance(frame, bytes) else frame.read()
    return hashlib.sha256(data).hexdigest()


def manifest_get(head: bytes) -> bool:
    return head.startswith(b"GET ") and b"/manifests/" in head.split(b"\r\n", 1)[0]


def test_a_manifest_read_cut_mid_body_resumes_and_hits(tmp_path, s3_bucket):
    url, endpoint = s3_bucket
    files = {f"inductor/fx/{i:04d}": os.urandom(64) for i in range(2000)}  # a manifest of ~400 KB
    write_tree(tmp_path / "src", files)
    published = cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url,
                    "--s3-endpoint-url", endpoint, "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    assert published.exit_code == 0, published.output
    root = tmp_path / "dst"
    with CuttingProxy(endpoint, after=100 * 1024, cuts=1, cut_if=manifest_get) as proxy:
        result = restore_through(proxy, url, root, "--strict")
        assert proxy.cut == 1
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads(result.stdout)["status"] == "hit"
    assert read_tree(root / "inductor") == {k.removeprefix("inductor/"): (v, 0o644) for k, v in files.items()}


def test_a_resumed_whole_object_read_never_mixes_two_versions(s3_bucket):
    url, endpoint = s3_bucket
    direct = open_store(url, endpoint_url=endpoint)
    old, new = os.urandom(300 * 1024), os.urandom(300 * 1024)
    assert direct.put_if("refs/big", old, None)

    def replace() -> None:  # another publisher moves the ref between the cut and the resume
        assert direct.put_if("refs/big", new, direct.get_versioned("refs/big")[1])

    def ref_get(head: bytes) -> bool:
        return head.startswith(b"GET ") and b"/refs/big " in head.split(b"\r\n", 1)[0]

    with CuttingProxy(endpoint, after=100 * 1024, cut_if=ref_get, on_cut=replace) as proxy:
        with pytest.raises(StoreError, match="PreconditionFailed|412"):
            open_store(url, endpoint_url=proxy.url).get_versioned("refs/big")
        assert proxy.cut == 1
    assert direct.get_versioned("refs/big")[0] == new


class _CutStream:
    """`data`, failing with StoreError once `cut` bytes were delivered (None: never)."""

    def __init__(self, data: bytes, cut: int | None):
        self._data, self._cut, self._pos = data, cut, 0

    def read(self, n: int = -1) -> bytes:
        if self._cut is not None and self._pos >= self._cut:
            raise StoreError("mem://", "connection reset")
        end = len(self._data) if n < 0 else self._pos + n
        if self._cut is not None:
            end = min(end, self._cut)
        chunk = self._data[self._pos : end]
        self._pos += len(chunk)
        return chunk

    def close(self) -> None:
        pass


CUT = st.one_of(st.integers(0, 3000), st.sampled_from([0, 1]))  # 0 and 1: cuts that make (almost) no progress


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=3000), offset=st.integers(0, 50),
       cuts=st.lists(CUT, max_size=streams.RESUMES + 2), chunk=st.integers(1, 700))  # fmt: skip
def test_resumable_delivers_exactly_the_bytes_or_the_error(data, offset, cuts, chunk):
    whole = bytes(offset) + data
    plan = list(cuts)
    opened = []

    def open_at(at: int, length: int):
        opened.append((at, length))
        assert at + length == len(whole)  # always the rest, never more
        return _CutStream(whole[at : at + length], plan.pop(0) if plan else None)

    stream = streams.Resumable(open_at(offset, len(data)), open_at, offset, len(data), name="blob")
    out = bytearray()
    try:
        while piece := stream.read(chunk):
            out += piece
    except StoreError:
        assert len(opened) == 1 + streams.RESUMES  # gave up only after every resume was spent
        assert bytes(out) == data[: len(out)]
    else:
        assert bytes(out) == data
    assert all(a <= b for (a, _), (b, _) in zip(opened, opened[1:]))  # never re-reads what it has


def test_an_error_after_the_last_byte_does_not_matter():
    data = b"all of it"
    stream = streams.Resumable(_CutStream(data, len(data)), lambda at, n: pytest.fail("reopened"), 0, len(data),
                               name="blob", resumes=0)  # fmt: skip
    assert stream.read(100) == data and stream.read(100) == b""
