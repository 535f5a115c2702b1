"""Processes publish at once, on S3 and PostgreSQL: overlapping trees under one bundle key, identical
pods' trees, and the same contents under different keys (their row inserts race)."""

import multiprocessing
import traceback

from sqlalchemy import text
from trees import read_tree, write_tree

from kcache import fingerprint, sources
from kcache import manifest as manifests
from kcache.index import Index
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import manifest_key, open_store, pack_key

WRITERS = 8


def tree_for(i: int) -> dict:
    files = {f"inductor/common/{n}.py": f"shared kernel {n}\n".encode() * 40 for n in range(150)}
    files.update({f"inductor/own{i}/{n}.so": f"writer {i} kernel {n}".encode() * 30 for n in range(20)})
    # Neighbours share these, so every blob is offered by two racing writers.
    files.update({f"triton/pair/{n}.cubin": f"pair {i // 2} cubin {n}".encode() * 25 for n in range(10)})
    return files


class InsertTogether:
    """An index whose first add_pack waits for every writer's: their row inserts overlap for sure."""

    def __init__(self, inner, barrier):
        self.inner, self.barrier = inner, barrier

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_pack(self, *args):
        if self.barrier is not None:
            self.barrier, barrier = None, self.barrier
            barrier.wait(timeout=120)
        return self.inner.add_pack(*args)


def _publisher(i, root, store_url, endpoint, index_url, facts, barrier, results, insert_barrier=None):
    try:
        store = open_store(store_url, endpoint_url=endpoint)
        index = InsertTogether(Index.open(index_url), insert_barrier)
        barrier.wait(timeout=120)
        result = publish(
            store, index, fingerprint.compute(facts), sources.select(), root=root, env={}, config=PublishConfig(jobs=4)
        )
        results.put((i, result.bundle_id, None))
    except BaseException:  # reported to the parent, which fails the test with it
        results.put((i, None, traceback.format_exc()))


def facts_of(fp, i: int, own_key: bool) -> dict:
    return {**fp.facts, "model.id": f"writer-{i}"} if own_key else dict(fp.facts)


def _run_publishers(roots, store_url, endpoint, index_url, fp, *, barrier_before_inserts=False, own_keys=False):
    """One spawned publisher per tree, released together; (their (i, bundle id, error) outcomes, processes).
    With `own_keys`, each publishes under its own bundle key (model.id): publishers of one key take
    turns (its publish lease), so only writers of different keys insert rows at the same moment."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(roots)), ctx.Queue()
    extra = (ctx.Barrier(len(roots)),) if barrier_before_inserts else ()
    procs = [
        ctx.Process(target=_publisher,
                    args=(i, root, store_url, endpoint, index_url, facts_of(fp, i, own_keys), barrier, results, *extra))
        for i, root in enumerate(roots)
    ]  # fmt: skip
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [err for _, _, err in outcomes if err]
    assert not errors, errors[0]
    return outcomes, procs


def test_eight_concurrent_publishers(tmp_path, s3_bucket, pg_index, fp):
    store_url, endpoint = s3_bucket
    roots = []
    for i in range(WRITERS):
        write_tree(tmp_path / f"tree{i}", tree_for(i))
        roots.append(tmp_path / f"tree{i}")
    outcomes, procs = _run_publishers(roots, store_url, endpoint, pg_index.url, fp)
    assert all(p.exitcode == 0 for p in procs)

    store = open_store(store_url, endpoint_url=endpoint)
    bundle_of = {i: bundle_id for i, bundle_id, _ in outcomes}
    assert len(set(bundle_of.values())) == WRITERS  # different trees, different bundles
    for bundle_id in bundle_of.values():
        manifest = manifests.parse(store.get_bytes(manifest_key(bundle_id)), bundle_id)
        assert all(store.exists(pack_key(p)) for p in {e.pack for e in manifest.entries})

    # No blob row twice, none missing: exactly one row per distinct content.
    distinct = {content for i in range(WRITERS) for content in tree_for(i).values()}
    with pg_index.engine.connect() as conn:
        assert conn.execute(text("select count(*) from blobs")).scalar() == len(distinct)
        assert conn.execute(text("select count(*) from bundles")).scalar() == WRITERS

    # The newest bundle is what a pod gets; every writer's bundle restores byte-identical.
    newest = pg_index.newest_bundle(fp.bundle_key)
    assert restore(store, pg_index, fp, tmp_path / "newest", jobs=8).bundle_id == newest.id
    for i, bundle_id in bundle_of.items():
        dst = tmp_path / f"restored{i}"
        assert restore(store, pg_index, fp, dst, jobs=8, bundle_id=bundle_id).status == "hit"
        for layer in ("inductor", "triton"):
            assert read_tree(dst / layer) == read_tree(roots[i] / layer)


def test_identical_pods_publishing_at_once_upload_each_pack_once(tmp_path, s3_bucket, pg_index, fp):
    """A Deployment's replicas warm up alike and publish together: one uploads, the rest wait for its
    lease and then find every blob in the index (without it, each uploaded a salted copy of all)."""
    store_url, endpoint = s3_bucket
    write_tree(tmp_path / "tree", tree_for(0))
    pods = 4
    outcomes, _ = _run_publishers([tmp_path / "tree"] * pods, store_url, endpoint, pg_index.url, fp)
    assert len({bundle_id for _, bundle_id, _ in outcomes}) == 1
    store = open_store(store_url, endpoint_url=endpoint)
    manifest = manifests.parse(store.get_bytes(manifest_key(outcomes[0][1])), outcomes[0][1])
    assert {o.key for o in store.list("packs")} == {pack_key(p) for p in {e.pack for e in manifest.entries}}


ORDERED_WRITERS, CONTENTS = 4, 2000


def ordered_tree(i: int) -> dict:
    """The same contents for every writer, under paths that sort in a different order per writer."""
    step = (7, 11, 13, 17)[i]  # coprime to CONTENTS: a permutation of the path order
    return {f"inductor/k/{(n * step) % CONTENTS:05d}.py": f"shared kernel {n}\n".encode() * 3 for n in range(CONTENTS)}


def test_publishers_with_differently_ordered_trees_do_not_deadlock(tmp_path, pg_index, fp):
    roots = []
    for i in range(ORDERED_WRITERS):
        write_tree(tmp_path / f"tree{i}", ordered_tree(i))
        roots.append(tmp_path / f"tree{i}")
    store_url = f"file://{tmp_path / 'store'}"
    outcomes, _ = _run_publishers(roots, store_url, None, pg_index.url, fp, barrier_before_inserts=True, own_keys=True)
    with pg_index.engine.connect() as conn:
        assert conn.execute(text("select count(*) from blobs")).scalar() == CONTENTS
    store = open_store(store_url)
    for i, bundle_id, _ in outcomes:
        dst = tmp_path / f"restored{i}"
        own = fingerprint.compute(facts_of(fp, i, True))
        assert restore(store, pg_index, own, dst, bundle_id=bundle_id).status == "hit"
        assert read_tree(dst / "inductor") == read_tree(roots[i] / "inductor")
