"""kcache.env is run by a shell: hostile text from the store, the index or the network must never
become shell code there, whatever path (miss, error, hit) writes the file.

Each test feeds arbitrary text (newlines, `$()`, backticks, quotes, NUL, lone surrogates, escape
sequences, plus one payload that would create a canary file if it ever ran) into one place an
attacker controls, lets restore write the env file, then sources it with bash in an empty
environment: nothing may run and exactly kcache's own variables may be set.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from xml.sax.saxutils import escape

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import write_tree

from kcache import canonical, envfile, fingerprint, sources
from kcache.cli import main
from kcache.errors import KcacheError
from kcache.index import Bundle, Index
from kcache.publish import publish
from kcache.readiness import RESTORE_MARKER
from kcache.refs import RefCatalog
from kcache.restore import read_state, restore
from kcache.store import manifest_key, open_store, ref_key
from kcache.store.local import LocalStore
from kcache.untrusted import one_line

PAYLOADS = (
    "\n: > CANARY\n",
    "\r\n: > CANARY #",
    "$(: > CANARY)",
    "`: > CANARY`",
    "'; : > CANARY; '",
    '"; : > CANARY; "',
    "\\\n: > CANARY",
    "\x00\n: > CANARY",
    "\u2028: > CANARY\u2029",
    "\x85: > CANARY",
    "\x1b]0;owned\x07\x1b[2J\n: > CANARY",
    "\ud800\udfff\n: > CANARY",
)
# Every code point, lone surrogates included: a JSON document may name them with \ud800 escapes.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
HOSTILE = st.tuples(ANY_TEXT, st.sampled_from(PAYLOADS), ANY_TEXT).map("".join)
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def scratch():
    """A fresh directory per hypothesis example (function fixtures are shared across examples)."""
    with tempfile.TemporaryDirectory(prefix="kcache-envsafety-") as tmp:
        yield Path(tmp)


def armed(text: str, canary: Path) -> str:
    return text.replace("CANARY", str(canary))


def sourced(root: Path) -> dict[str, str]:
    """What `. ROOT/kcache.env` sets in an empty environment, asserting that nothing ran or failed."""
    done = subprocess.run(
        ["env", "-i", "/bin/bash", "--norc", "--noprofile", "-c", '. "$1" && exec /usr/bin/env -0', "bash",
         str(root / envfile.NAME)],
        capture_output=True, cwd=root, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    env = dict(item.split(b"=", 1) for item in done.stdout.split(b"\0") if item)
    for shell_own in (b"PWD", b"SHLVL", b"_"):
        env.pop(shell_own, None)
    return {name.decode(): value.decode("utf-8", "surrogateescape") for name, value in env.items()}


def assert_inert(root: Path, canary: Path, layer_names=()) -> None:
    assert sourced(root) == sources.all_exports(root, layer_names)
    assert not canary.exists(), "kcache.env ran code"
    comments = [line for line in (root / envfile.NAME).read_bytes().splitlines() if line.startswith(b"#")]
    assert len(comments) == 1
    state = json.loads((root / RESTORE_MARKER).read_text())  # the marker stays valid JSON
    assert isinstance(state["reason"], str)


# ---- the env file writer itself ---------------------------------------------------------------


@FEW
@given(HOSTILE)
def test_any_comment_is_one_inert_line(text):
    with scratch() as tmp:
        canary = tmp / "canary"
        exports = sources.all_exports(tmp)
        envfile.write(tmp, exports, armed(text, canary))
        (tmp / RESTORE_MARKER).write_text('{"reason": ""}')
        assert_inert(tmp, canary)


@pytest.mark.parametrize("name", ["A B", "X;touch /tmp/x", "1A", "", "A\nB", "A$(id)"])
def test_names_that_are_not_shell_names_are_refused(tmp_path, name):
    with pytest.raises(KcacheError):
        envfile.render({name: "v"})


def test_one_line_is_bounded_and_keeps_plain_text():
    assert one_line("bundle abc is yanked") == "bundle abc is yanked"
    assert one_line("a\n\tb\r\nc\x1b[2Jd\ud800") == "a b c?[2Jd?"
    assert len(one_line("x" * 10_000)) == 300


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.integers(min_value=4, max_value=300))
def test_one_line_shows_no_control_and_no_line_break_whatever_the_text(text, limit):
    line = one_line(text, limit)
    assert len(line) <= limit and "  " not in line and line == line.strip()
    assert all(ch.isprintable() for ch in line), repr(line)
    if text.isascii() and text.isprintable():  # plain text keeps every word, spaces collapsed
        words = " ".join(text.split())
        assert line == (words if len(words) <= limit else words[: limit - 3] + "...")


# ---- every restore path that writes kcache.env ------------------------------------------------


FACTS = {"os": "linux", "arch": "x86_64", "python": "3.11", "cpu.isa": "avx2", "model.id": "m"}


def fixed_fp() -> fingerprint.Fingerprint:
    return fingerprint.compute(FACTS)


def put_ref(store: LocalStore, key: str, doc: dict) -> None:
    store.put_bytes(ref_key(key), json.dumps(doc).encode())


@FEW
@given(HOSTILE)
def test_hostile_ref_bundle_key_reaches_no_shell(text):
    """The error path: the ref names another bundle key, and the message quotes it."""
    fp = fixed_fp()
    with scratch() as tmp:
        canary, store = tmp / "canary", LocalStore(tmp / "store")
        put_ref(store, fp.bundle_key, {"bundle_key": armed(text, canary), "manifest": "0" * 64,
                                       "created_at": "2026-01-01T00:00:00+00:00"})  # fmt: skip
        with pytest.raises(KcacheError):
            restore(store, RefCatalog(store), fp, tmp / "root")
        assert read_state(tmp / "root")["status"] == "error"
        assert_inert(tmp / "root", canary)


@FEW
@given(HOSTILE)
def test_hostile_ref_manifest_id_reaches_no_shell(text):
    """The id a ref names goes into the miss reason (yanked) or an error about the manifest."""
    fp = fixed_fp()
    with scratch() as tmp:
        canary, store = tmp / "canary", LocalStore(tmp / "store")
        put_ref(store, fp.bundle_key, {"bundle_key": fp.bundle_key, "manifest": armed(text, canary),
                                       "created_at": "2026-01-01T00:00:00+00:00"})  # fmt: skip
        try:
            restore(store, RefCatalog(store), fp, tmp / "root")
        except KcacheError:
            pass
        assert read_state(tmp / "root")["status"] in ("miss", "error")
        assert_inert(tmp / "root", canary)


@FEW
@given(HOSTILE)
def test_hostile_manifest_bundle_key_reaches_no_shell(text):
    """A manifest stored under its own SHA-256 (so it passes the hash check) names another key."""
    fp = fixed_fp()
    with scratch() as tmp:
        canary, store = tmp / "canary", LocalStore(tmp / "store")
        doc = {"schema": 1, "bundle_key": armed(text, canary), "toolchain_key": fp.toolchain_key,
               "workload_key": fp.workload_key, "facts": {}, "layers": ["inductor"], "entries": []}  # fmt: skip
        try:  # canonical, so the manifest parses and its hostile key reaches the mismatch message
            data = canonical.dumps(doc)
        except UnicodeEncodeError:  # \u escapes: lone surrogates survive the trip (and are refused)
            data = json.dumps(doc, sort_keys=True).encode()
        manifest_id = canonical.sha256(data)
        store.put_bytes(manifest_key(manifest_id), data)
        index = Index.open(f"sqlite:///{tmp / 'index.db'}")
        try:
            index.add_bundle(Bundle(manifest_id, fp.bundle_key, fp.toolchain_key, fp.workload_key, None, {},
                                    ("inductor",), 0, 0, datetime.now(timezone.utc) + timedelta(hours=1),
                                    "attacker", "active"))  # fmt: skip
            with pytest.raises(KcacheError):
                restore(store, index, fp, tmp / "root")
        finally:
            index.close()
        assert_inert(tmp / "root", canary)


def test_hit_comment_and_values_are_inert(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"a", "extra/trt/t": b"t"})
    publish(store, sqlite_index, fp, sources.select() + [sources.ExtraSource("trt")], root=tmp_path / "src", env={})
    root = tmp_path / "we'ird $(: > canary) `x`\nroot"
    result = restore(store, sqlite_index, fp, root)
    assert result.status == "hit"
    assert_inert(root, tmp_path / "canary", result.layers)


@pytest.mark.parametrize("name", ["new\nline", "carriage\rreturn", "line\u2028separator", "we'ird $x `y` \\"])
def test_the_env_file_reads_back_as_a_shell_reads_it(tmp_path, store, sqlite_index, fp, name):
    """prebake runs its warmup child with ROOT/kcache.env read back by envfile.read. A ROOT whose name
    held a line break, or any character str.splitlines breaks at, was cut inside a quoted value, and
    prebake died with a traceback (exit 70) where a shell sources the same file fine."""
    root = tmp_path / name
    restore(store, sqlite_index, fp, root)
    assert envfile.read(root / envfile.NAME) == sourced(root)


# ---- an S3 endpoint that answers with hostile error documents ---------------------------------


class HostileS3:
    """Answers every request with 403 and an S3 error document whose Code and Message are `text`."""

    def __init__(self, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def s3_error_body(text: str) -> bytes:
    safe = escape(text.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{safe}</Code><Message>{safe}</Message></Error>"
    return xml.encode("utf-8")


@pytest.mark.parametrize("payload", [*PAYLOADS, b"<Error><Code>\xff\xfe\n: > CANARY</Code></Error>"])
def test_hostile_s3_error_reaches_no_shell_and_no_terminal(tmp_path, monkeypatch, payload):
    canary, root = tmp_path / "canary", tmp_path / "root"
    body = armed(payload.decode("latin-1"), canary).encode("latin-1") if isinstance(payload, bytes) else None
    server = HostileS3(body or s3_error_body(armed(payload, canary)))
    monkeypatch.setenv("KCACHE_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        store = open_store("s3://bucket/cache", endpoint_url=server.url)
        with pytest.raises(KcacheError):
            restore(store, RefCatalog(store), fixed_fp(), root, timeout=30)
        assert_inert(root, canary)
        result = CliRunner().invoke(main, ["restore", "--into", str(root), "--store", "s3://bucket/cache",
                                           "--s3-endpoint-url", server.url, "--index", "none", "--model", "m"],
                                    catch_exceptions=False)  # fmt: skip
    finally:
        server.close()
    assert result.exit_code == 0
    assert_inert(root, canary)
    lines = result.stderr.splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["kcache", "  hint"], result.stderr
    assert not any(ch in result.stderr for ch in "\x1b\x07\x00\r\x85\u2028")


def test_log_lines_on_the_terminal_are_one_line_each():
    code = (
        "import logging\nfrom kcache.cli import main\nmain.callback(0)\n"
        "logging.getLogger('kcache.restore').warning('bundle %s', 'x\\n: > CANARY\\x1b[2J\\u2028y')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr == "kcache: WARNING: bundle x : > CANARY?[2J y\n"
