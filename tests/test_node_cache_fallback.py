"""The node cache can only cost time, also when its copy of a pack goes bad after a restore hashed it: a
peer on the node rewrites or truncates the file in place, or the disk fails to read it. Restore then
gets those bytes from the store, and the node drops the copy so that the next pod fetches it again.

    kcache restore --node-cache DIR ──► NodeCacheStore ──► CuttingProxy (counts pack GETs) ──► moto's S3 server
    a peer ──► DIR/packs/<hh>/<id>, right after the restore verified it (the seam: nodedir.touch)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from cutting_proxy import CuttingProxy
from faulty import CountingStore
from trees import read_tree, write_tree

from kcache import fetch, packs, publish
from kcache import restore as restoring
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.store import nodedir, open_store, pack_key
from kcache.store.local import LocalStore
from kcache.store.nodecache import NodeCacheStore

KiB = 1024
MODEL = "node-cache-fallback"


class PackGets:
    """GETs per pack as the proxy sees them (its `cut_if`, which never asks for a cut)."""

    def __init__(self):
        self.by_pack: Counter[str] = Counter()

    def __call__(self, head: bytes) -> bool:
        line = head.split(b"\r\n", 1)[0].decode()
        if line.startswith("GET ") and "/packs/" in line:
            self.by_pack[line.split()[1].split("?")[0].rsplit("/", 1)[-1]] += 1
        return False


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def bundle(tmp_path, s3_bucket, monkeypatch):
    """A bundle of several small packs in S3, and a node cache that a prefetch filled with all of them."""
    url, endpoint = s3_bucket
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 256 * KiB)
    files = {f"inductor/fx/{i:02d}": os.urandom(200 * KiB) for i in range(5)}
    files["triton/k/kernel.cubin"] = os.urandom(150 * KiB)
    write_tree(tmp_path / "src", files)
    published = cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url, "--s3-endpoint-url",
                    endpoint, "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    assert published.exit_code == 0, published.output + published.stderr
    packs = sorted(info.key.rsplit("/", 1)[-1] for info in open_store(url, endpoint_url=endpoint).list("packs/"))
    assert len(packs) >= 3
    node = tmp_path / "node"
    warmed = cli("prefetch", "--node-cache", node, "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint,
                 "--index", "none", "--once", "--json")  # fmt: skip
    assert warmed.exit_code == 0, warmed.output + warmed.stderr
    assert all(cached(node, p).exists() for p in packs)
    return url, endpoint, packs, files, node


def cached(node: Path, pack: str) -> Path:
    return node / "packs" / pack[:2] / pack


def restore(url, endpoint, root, node):
    """`kcache restore --node-cache` through a proxy that counts pack GETs: (exit code, JSON, GETs per pack)."""
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        result = cli("restore", "--into", root, "--model", MODEL, "--store", url, "--s3-endpoint-url", proxy.url,
                     "--index", "none", "--node-cache", node, "--strict", "--json")  # fmt: skip
    return result.exit_code, json.loads(result.stdout), gets.by_pack


def assert_restored(root: Path, files: dict[str, bytes]) -> None:
    tree = {f"{layer}/{path}": content for layer in ("inductor", "triton")
            for path, (content, _mode) in read_tree(root / layer).items()}  # fmt: skip
    assert tree == files


# ---- what a peer (or the disk) does to a cached pack once a reader has hashed it ----------------------


def rewrite(fd: int, path: Path) -> None:
    """Every byte changed in place: same inode, same size, so nothing but the content tells."""
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(bytes(b ^ 0x5A for b in data))


def truncate(fd: int, path: Path) -> None:
    """A third of it left: the reader's next reads end early (short reads, then EOF)."""
    os.truncate(path, os.path.getsize(path) // 3)


def read_error(fd: int, path: Path) -> None:
    """Every read of the open copy fails (as EIO from a bad disk would): the descriptor the node cache
    reads through now names a directory, so read(2) itself fails (EISDIR)."""
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.dup2(directory, fd)
    finally:
        os.close(directory)


class Peer:
    """Damages each chosen pack right after a reader verified it, before it serves a byte of it: once (a
    peer's write), or at every open (`persistent`: a disk that keeps failing to read those blocks)."""

    def __init__(self, monkeypatch, damage, victims, *, persistent=False):
        self.damage, self.victims, self.damaged = damage, set(victims), []
        touch = nodedir.touch

        def verified(fd: int, path: Path) -> None:
            if path.name in self.victims and (persistent or path.name not in self.damaged):
                if path.name not in self.damaged:
                    self.damaged.append(path.name)
                self.damage(fd, path)
            touch(fd, path)

        monkeypatch.setattr(nodedir, "touch", verified)

    def stop(self) -> None:
        self.victims = set()


DAMAGES = {"rewritten": rewrite, "truncated": truncate, "unreadable": read_error}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_pack_damaged_after_it_was_hashed_is_read_from_the_store_and_dropped(tmp_path, bundle, monkeypatch, caplog,
                                                                                damage):  # fmt: skip
    url, endpoint, packs, files, node = bundle
    victim = packs[len(packs) // 2]
    peer = Peer(monkeypatch, DAMAGES[damage], [victim], persistent=damage == "unreadable")
    with caplog.at_level(logging.WARNING, logger="kcache"):
        code, result, gets = restore(url, endpoint, tmp_path / "root", node)
    assert peer.damaged == [victim]
    assert (code, result["status"]) == (0, "hit"), result
    assert_restored(tmp_path / "root", files)
    if damage == "rewritten":  # only the blobs' check sees it: what was not yet staged comes from the store
        assert gets[victim] >= 1, "the damaged pack is read from the store"
    else:  # the node cache sees it itself: the read resumes from the store, the other packs stay the node's
        assert gets == Counter({victim: 1}), "the bytes left of the damaged pack, from the store, once"
    assert any(str(node) in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING), caplog.text
    assert not cached(node, victim).exists(), "the damaged copy is dropped: the next pod must not trust it"
    assert not list(tmp_path.glob("root/.kcache-staging-*"))

    peer.stop()  # the next pod on the node
    code, again, gets = restore(url, endpoint, tmp_path / "root2", node)
    assert (code, again["status"]) == (0, "hit"), again
    assert_restored(tmp_path / "root2", files)
    assert gets == Counter({victim: 1}), "the dropped pack is fetched once again, the others come from the node"
    assert hashlib.sha256(cached(node, victim).read_bytes()).hexdigest() == victim


@pytest.mark.parametrize("damage", ["rewritten", "truncated"])
def test_a_peer_that_damages_every_pack_after_it_is_hashed_costs_time_only(tmp_path, bundle, monkeypatch, damage):
    """The retry reads the store itself: a node cache that goes bad again must not fail it a second time."""
    url, endpoint, packs, files, node = bundle
    peer = Peer(monkeypatch, DAMAGES[damage], packs)
    code, result, gets = restore(url, endpoint, tmp_path / "root", node)
    assert (code, result["status"]) == (0, "hit"), result
    assert_restored(tmp_path / "root", files)
    assert peer.damaged and set(peer.damaged) <= set(gets), "what the peer damaged came from the store"
    peer.stop()  # the next pod: a damaged copy the first one never got to read is hashed, not trusted
    code, again, _gets = restore(url, endpoint, tmp_path / "root2", node)
    assert (code, again["status"]) == (0, "hit"), again
    assert_restored(tmp_path / "root2", files)
    assert all(hashlib.sha256(cached(node, p).read_bytes()).hexdigest() == p for p in packs)


def test_a_pack_that_is_corrupt_in_the_store_fails_the_restore_as_before(tmp_path, bundle, caplog):
    """The store's own bad bytes are not the node cache's: no second fetch from the store, the same error."""
    url, endpoint, packs, _files, node = bundle
    victim = packs[0]
    store = open_store(url, endpoint_url=endpoint)
    data = bytearray(store.get_bytes(pack_key(victim)))
    data[len(data) // 3] ^= 0x01  # inside a blob: the pack no longer hashes to its id, nor that blob to its own
    store.delete(pack_key(victim))
    store.put_bytes(pack_key(victim), bytes(data))
    cached(node, victim).unlink()  # the node must fetch it, and refuses what does not hash to its id
    with caplog.at_level(logging.WARNING, logger="kcache"):
        code, result, gets = restore(url, endpoint, tmp_path / "root", node)
    assert code == ExitCode.CORRUPT and result["status"] == "error", result
    assert gets == Counter({victim: 2}), "the fill's GET, then the blobs' range: nothing read again"
    assert not cached(node, victim).exists()
    assert not [r for r in caplog.records if "from the store alone" in r.getMessage()]


def rewrite_the_middle(fd: int, path: Path) -> None:
    """The second quarter changed in place: a large blob's seek table, at its end, still reads right."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 4)
        data = f.read(size // 4)
        f.seek(size // 4)
        f.write(bytes(b ^ 0x5A for b in data))


@pytest.fixture
def split_blobs(monkeypatch):
    """Frames of 4 KiB and parts of two frames: every file of the bundle is a blob restore splits into
    parts fetched in parallel, written at offsets into its staged file (kcache.fetch)."""
    for module in (packs, publish, restoring):
        monkeypatch.setattr(module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(packs, "SEEK_TAIL_GUESS", 64)
    monkeypatch.setattr(fetch, "PART_BYTES", 2 * 4096 + 200)


def test_a_split_blob_whose_copy_is_rewritten_after_hashing_is_fetched_again(tmp_path, split_blobs, bundle,
                                                                              monkeypatch):  # fmt: skip
    """The blob's staged file, written part-way from the bad copy, is replaced, not left half-written."""
    url, endpoint, packs_, files, node = bundle
    victim = packs_[0]
    peer = Peer(monkeypatch, rewrite_the_middle, [victim])
    code, result, gets = restore(url, endpoint, tmp_path / "root", node)
    assert peer.damaged == [victim]
    assert (code, result["status"]) == (0, "hit"), result
    assert_restored(tmp_path / "root", files)
    assert gets[victim] >= 1 and not cached(node, victim).exists()


# ---- the library: a copy that failed is not served again by the same wrapper ------------------------------


def test_a_dropped_pack_is_read_from_the_store_by_the_same_wrapper(tmp_path):
    backing = CountingStore(LocalStore(tmp_path / "store"))
    data = os.urandom(100 * KiB)
    pack = hashlib.sha256(data).hexdigest()
    backing.put_bytes(pack_key(pack), data)
    node = tmp_path / "node"
    cache = NodeCacheStore(backing, node)
    cache.warm(pack)
    with cache.open_range(pack_key(pack), 10, 100) as stream:
        assert stream.read() == data[10:110]
    assert cache.drop([pack, "ab" * 32]) == [pack], "only what it served from the node is its to drop"
    assert cached(node, pack).read_bytes() == data, "a copy that still hashes to its id is kept for the node"
    before = backing.read["packs"]
    with cache.open_range(pack_key(pack), 10, 100) as stream:  # ...but not this wrapper's to serve now
        assert stream.read() == data[10:110]
    assert backing.read["packs"] - before == 100


# ---- a node cache that is misconfigured costs its reads, not the warm start ------------------------------


@pytest.mark.parametrize("setting", ["lots", "-5", "12 parsecs"])
def test_a_typo_in_the_node_caches_cap_restores_from_the_store_with_a_warning(bundle, tmp_path, monkeypatch,
                                                                                setting):  # fmt: skip
    url, endpoint, packs, files, node = bundle
    monkeypatch.setenv("KCACHE_NODE_CACHE_MAX_BYTES", setting)
    code, doc, gets = restore(url, endpoint, tmp_path / "root", node)
    assert code == 0 and doc["status"] == "hit", doc
    assert_restored(tmp_path / "root", files)
    assert sorted(gets) == packs  # every pack from the store: the node cache was not used


def test_a_file_where_the_node_cache_should_be_restores_from_the_store_with_a_warning(bundle, tmp_path):
    url, endpoint, packs, files, _node = bundle
    planted = tmp_path / "not-a-dir"
    planted.write_bytes(b"x")
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        result = cli("restore", "--into", tmp_path / "root", "--model", MODEL, "--store", url, "--s3-endpoint-url",
                     proxy.url, "--index", "none", "--node-cache", planted, "--strict", "--json")  # fmt: skip
    assert result.exit_code == 0 and json.loads(result.stdout)["status"] == "hit", result.output
    assert "node cache" in result.stderr and "not a directory" in result.stderr
    assert_restored(tmp_path / "root", files)
    assert sorted(gets.by_pack) == packs and planted.read_bytes() == b"x"
