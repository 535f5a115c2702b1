"""GC judges every age by the clock that stamped it, never by the gc host's own.

    condemned_at, created_at    stamped by the index's clock (PostgreSQL's server time; SQLite's host)
    ObjectInfo/Leftover times   stamped by the store's clock (S3's LastModified; file:// mtimes)

A gc CronJob on a node whose clock was ahead by more than --grace swept a pack a publish was about
to commit, aborted a publish's multipart upload in flight, and deleted bundles younger than
--older-than. The gc host's clock is shifted here through `gc._host_now`; the index, the store
and the publishers are real and keep their own clocks.
"""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime, parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gc_helpers import LAYERS, CommitsWhenReleased, packs_of, publish_tree
from trees import write_tree

from kcache import fingerprint, gc
from kcache.publish import publish
from kcache.restore import restore
from kcache.store import manifest_key, open_store, pack_key

POLICY = gc.Policy(keep_last=3, older_than=timedelta(days=7), grace=timedelta(hours=6))
AHEAD, BEHIND = timedelta(hours=7), -timedelta(hours=7)


def _gc_host_clock(monkeypatch, skew: timedelta) -> None:
    """The gc host's clock reads `skew` off true time; nothing else's does."""
    monkeypatch.setattr(gc, "_host_now", lambda: datetime.now(timezone.utc) + skew)






@pytest.mark.parametrize(("condemner", "sweeper"), [(timedelta(0), AHEAD), (BEHIND, timedelta(0))],
                         ids=["sweeper-7h-ahead", "condemner-7h-behind"])  # fmt: skip
def test_a_pack_condemned_moments_ago_waits_out_grace_on_any_gc_hosts_clock(tmp_path, store, index, fp, monkeypatch,
                                                                            condemner, sweeper):  # fmt: skip
    """One gc condemns the pack a paused publish has just uploaded and revived; a 6 h-grace gc runs
    moments later. Either run's host clock 7 h off (the sweeper's ahead, or the condemner's behind,
    stamping "7 h ago") made the second sweep it, and the publish committed a bundle naming a
    deleted pack."""
    publish_tree(tmp_path, store, index, fp, b"base" * 100, "v0")
    racer = fingerprint.compute({**fp.facts, "model.id": "racer"})
    write_tree(tmp_path / "v1", {"inductor/kernel.so": b"a brand new kernel" * 100})
    pausing = CommitsWhenReleased(index)
    box = {}
    publisher = threading.Thread(target=lambda: box.update(r=publish(store, pausing, racer, LAYERS,
                                                                     root=tmp_path / "v1", env={})))  # fmt: skip
    publisher.start()
    try:
        assert pausing.reached.wait(60)  # its pack is uploaded, recorded, revived; no bundle names it yet
        _gc_host_clock(monkeypatch, condemner)
        first = gc.plan(store, index, POLICY)
        assert len(first.condemn) == 1
        gc.execute(store, index, first)
        _gc_host_clock(monkeypatch, sweeper)
        second = gc.plan(store, index, POLICY)
        assert second.sweep == () and [p.id for p in second.waiting] == [first.condemn[0].id]
        gc.execute(store, index, second)
    finally:
        pausing.release.set()
        publisher.join(60)
    result = box["r"]
    assert all(store.exists(pack_key(p)) for p in packs_of(store, result.bundle_id))
    pod = restore(store, index, racer, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", result.bundle_id), pod.reason


def test_a_condemned_pack_is_swept_once_grace_has_passed_on_the_index_clock(tmp_path, store, index, fp, monkeypatch):
    """The other side of the same rule: a condemnation stamped by a gc host 7 h ahead is not 7 h
    younger than it is; a run after --grace (on the index's clock) sweeps it."""
    old = publish_tree(tmp_path, store, index, fp, b"old kernel" * 100, "v1")
    new = publish_tree(tmp_path, store, index, fp, b"new kernel" * 100, "v2")
    old_packs = packs_of(store, old.bundle_id) - packs_of(store, new.bundle_id)
    policy = gc.Policy(keep_last=1, older_than=timedelta(0), grace=timedelta(hours=6))
    _gc_host_clock(monkeypatch, AHEAD)
    gc.execute(store, index, gc.plan(store, index, policy))  # old goes; its packs are condemned
    _gc_host_clock(monkeypatch, timedelta(0))
    later = gc.plan(store, index, policy, now=datetime.now(timezone.utc) + timedelta(hours=6, minutes=30))
    assert {p.id for p in later.sweep} == old_packs


def test_older_than_is_judged_by_the_index_clock(tmp_path, store, index, fp, monkeypatch):
    """--older-than 6h on a gc host 7 h ahead deleted a bundle the index had stamped a moment ago."""
    young = publish_tree(tmp_path, store, index, fp, b"young kernel" * 100, "v1")
    publish_tree(tmp_path, store, index, fp, b"newest kernel" * 100, "v2")
    policy = gc.Policy(keep_last=1, older_than=timedelta(hours=6), grace=timedelta(hours=6))
    _gc_host_clock(monkeypatch, AHEAD)
    plan = gc.plan(store, index, policy)
    assert plan.delete_bundles == ()
    assert gc.execute(store, index, plan).bundles_deleted == 0
    assert index.get_bundle(young.bundle_id).status == "active" and store.exists(manifest_key(young.bundle_id))


def _fresh_writes(store) -> None:
    """What publishes in flight have in the store right now: a pack not yet recorded, a manifest not
    yet committed, and a write not yet finished (a file:// temp file, an S3 multipart upload)."""
    store.put_bytes(pack_key("e" * 64), b"a pack whose row is about to be written")
    store.put_bytes(manifest_key("d" * 64), b"a manifest whose bundle row is about to be written")
    if hasattr(store, "client"):
        full = store._key(pack_key("c" * 64))
        upload = store.client.create_multipart_upload(Bucket=store.bucket, Key=full)["UploadId"]
        store.client.upload_part(Bucket=store.bucket, Key=full, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    else:
        (store.root / "packs/cc").mkdir(parents=True)
        (store.root / f"packs/cc/.tmp-{'c' * 64}-x1y2").write_bytes(b"half a pack")


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_writes_in_flight_are_judged_by_the_stores_clock(request, sqlite_index, monkeypatch, kind):
    """On a gc host 7 h ahead, every object a publish had just written looked 7 h old: its
    multipart upload was aborted, its manifest deleted, its pack adopted as an orphan."""
    store = request.getfixturevalue("store" if kind == "file" else "s3_store")
    _fresh_writes(store)
    _gc_host_clock(monkeypatch, AHEAD)
    plan = gc.plan(store, sqlite_index, POLICY)
    assert (plan.orphans, plan.adopt, plan.leftovers) == ((), (), ())
    gc.execute(store, sqlite_index, plan)
    assert store.exists(pack_key("e" * 64)) and store.exists(manifest_key("d" * 64))
    assert [left.key for left in store.leftovers()] != []


class _DateProxy(ThreadingHTTPServer):
    """An HTTP proxy in front of moto whose answers carry the Date header `date(moto's)` (none if
    that is None). A Date 7 h later is an S3 server whose clock stamped each LastModified 7 h before."""

    daemon_threads = True

    def __init__(self, upstream: str, date: Callable[[str], str | None]):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.date = (host, int(port)), date
        super().__init__(("127.0.0.1", 0), _Forward)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        self.send_response_only(answer.status, answer.reason)
        hop = {"date", "connection", "transfer-encoding", "content-length", "server"}
        for name, value in answer.getheaders():
            if name.lower() not in hop:
                self.send_header(name, value)
        date = self.server.date(answer.getheader("Date"))
        if date is not None:
            self.send_header("Date", date)
        self.send_header("Content-Length", answer.getheader("Content-Length", "0") if self.command == "HEAD"
                         else str(len(data)))  # fmt: skip
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def log_message(self, *args) -> None:
        pass


@contextmanager
def _through_proxy(s3_bucket, date: Callable[[str], str | None]):
    """(the s3_bucket's store reached through a _DateProxy, the same store reached directly)"""
    url, endpoint = s3_bucket
    proxy = _DateProxy(endpoint, date)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield open_store(url, endpoint_url=proxy.url), open_store(url, endpoint_url=endpoint)
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()


def _seven_hours_on(date: str) -> str:
    return format_datetime(parsedate_to_datetime(date) + AHEAD, usegmt=True)


@pytest.fixture
def store_seven_hours_on(s3_bucket):
    with _through_proxy(s3_bucket, _seven_hours_on) as stores:
        yield stores


def test_s3_objects_are_aged_by_the_stores_date(store_seven_hours_on, sqlite_index):
    """An S3 server whose clock is 7 h ahead of the gc host stamps LastModified by that clock: what
    it dated 7 h before its own now is past --grace, though the gc host calls it new."""
    through_proxy, direct = store_seven_hours_on
    _fresh_writes(direct)
    plan = gc.plan(through_proxy, sqlite_index, POLICY)
    assert [o.key for o in plan.adopt] == [pack_key("e" * 64)]
    assert [o.key for o in plan.orphans] == [manifest_key("d" * 64)]
    assert [left.key for left in plan.leftovers] == [pack_key("c" * 64)]
    gc.execute(through_proxy, sqlite_index, plan)
    assert list(direct.leftovers()) == [] and not direct.exists(manifest_key("d" * 64))
    assert through_proxy.now() - direct.now() >= timedelta(hours=6, minutes=59)


@pytest.mark.parametrize("date", [None, "yesterday\x1b[2J"], ids=["none", "garbage"])
def test_an_s3_server_without_a_usable_date_is_aged_by_this_hosts_clock(s3_bucket, sqlite_index, caplog, date):
    """As before stores had a clock, and said: what the server sent is not echoed raw."""
    with _through_proxy(s3_bucket, lambda _moto: date) as (through_proxy, direct), caplog.at_level(logging.WARNING):
        _fresh_writes(direct)
        assert gc.plan(through_proxy, sqlite_index, POLICY).leftovers == ()
        later = gc.plan(through_proxy, sqlite_index, POLICY, now=datetime.now(timezone.utc) + AHEAD)
        assert [left.key for left in later.leftovers] == [pack_key("c" * 64)]
    assert "no valid Date header" in caplog.text and "\x1b" not in caplog.text


def test_gc_warns_when_its_clock_disagrees_with_the_index_or_the_store(store, index, monkeypatch, caplog):
    _gc_host_clock(monkeypatch, AHEAD)
    with caplog.at_level(logging.WARNING, logger="kcache.gc"):
        gc.plan(store, index, POLICY)
    assert "25200 s ahead of the index's" in caplog.text and "25200 s ahead of the store's" in caplog.text


def test_the_skew_warning_names_the_index_without_its_password(store, pg_index, monkeypatch, caplog):
    from kcache.index import Index

    with_password = Index.open(pg_index.url.replace("://postgres@", "://postgres:hunter2@", 1))
    assert "hunter2" in with_password.url  # (the test server trusts every password)
    _gc_host_clock(monkeypatch, AHEAD)
    with caplog.at_level(logging.WARNING, logger="kcache.gc"):
        gc.plan(store, with_password, POLICY)
    with_password.close()
    assert "ahead of the index's" in caplog.text and "hunter2" not in caplog.text


def test_gc_plans_through_a_store_wrapper_by_its_inner_stores_clock(tmp_path, store, sqlite_index, fp):
    """The node cache wrapper ages objects by the store it wraps (file://: this host's clock)."""
    from kcache.store.nodecache import NodeCacheStore

    publish_tree(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    store.put_bytes(manifest_key("d" * 64), b"an orphan")
    wrapped = NodeCacheStore(store, tmp_path / "node-cache")
    assert gc.plan(wrapped, sqlite_index, POLICY).orphans == ()
    later = gc.plan(wrapped, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(hours=7))
    assert [o.key for o in later.orphans] == [manifest_key("d" * 64)]


@pytest.fixture
def lagging_index(pg_index):
    """`pg_index` on a PostgreSQL server whose clock reads 7 h behind this host's: the sessions'
    now() and statement_timestamp() (which publish stamps bundle rows with) are functions searched
    for before pg_catalog's."""
    from kcache.index import Index

    with pg_index.engine.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA IF NOT EXISTS lagging")
        conn.exec_driver_sql("CREATE OR REPLACE FUNCTION lagging.now() RETURNS timestamptz LANGUAGE sql STABLE "
                             "AS $$ SELECT pg_catalog.now() - interval '7 hours' $$")  # fmt: skip
        conn.exec_driver_sql("CREATE OR REPLACE FUNCTION lagging.statement_timestamp() RETURNS timestamptz "
                             "LANGUAGE sql STABLE "
                             "AS $$ SELECT pg_catalog.statement_timestamp() - interval '7 hours' $$")  # fmt: skip
    index = Index.open(f"{pg_index.url}?options=-c%20search_path%3Dpublic%2Clagging%2Cpg_catalog")
    yield index
    index.close()


def test_bundle_ages_are_judged_by_the_postgresql_servers_clock(tmp_path, store, lagging_index, fp):
    """The gc host's clock is right and the server's 7 h behind: a bundle the server stamped a
    moment ago is not past --older-than 6h, though this host's clock would call it 7 h old."""
    young = publish_tree(tmp_path, store, lagging_index, fp, b"young kernel" * 100, "v1")
    publish_tree(tmp_path, store, lagging_index, fp, b"newest kernel" * 100, "v2")
    host = datetime.now(timezone.utc)
    assert lagging_index.get_bundle(young.bundle_id).created_at < host - timedelta(hours=6)  # the server's stamp
    policy = gc.Policy(keep_last=1, older_than=timedelta(hours=6), grace=timedelta(hours=6))
    plan = gc.plan(store, lagging_index, policy)
    assert plan.delete_bundles == () and plan.now < host - timedelta(hours=6)
    assert gc.execute(store, lagging_index, plan).bundles_deleted == 0
    assert lagging_index.get_bundle(young.bundle_id).status == "active"
