"""Text from the index or the store reaches the terminal without escape sequences or line breaks.

A model id, a fact value, a creator, a manifest path or an object name is written by whoever can
write the index or the store. Printed raw, "\\x1b]0;...\\x07" retitles the operator's terminal,
"\\x1b[2J" clears it, and a newline forges a line of output (a fake "no problems"). Every
human-readable command shows such values through one formatter; --json is escaped by json.dumps.
"""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from fixed_facts import FACTS
from trees import write_tree

from kcache import fingerprint, sources
from kcache.cli import main
from kcache.publish import publish
from kcache.store.local import LocalStore

EVIL = "m\x1b]0;pwned\x07\x1b[2J\nkcache: checked 0 bundles: no problems\r\x9b31m"
CONTROLS = ("\x1b", "\x07", "\r", "\x9b")


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A store and SQLite index holding one bundle whose model id, facts and file name are hostile."""
    store = LocalStore(tmp_path / "store")
    index_url = f"sqlite:///{tmp_path / 'index.db'}"
    from kcache.index import Index

    index = Index.open(index_url)
    fp = fingerprint.compute({**FACTS, "model.id": EVIL, "extra.note": EVIL})
    write_tree(tmp_path / "src", {"inductor/ok": b"fine", "inductor/k\x1b[31mred": b"red"})
    bundle = publish(store, index, fp, sources.select(), root=tmp_path / "src", env={}).bundle_id
    index.close()
    monkeypatch.setenv("KCACHE_STORE", store.url)
    monkeypatch.setenv("KCACHE_INDEX", index_url)
    return store, bundle, fp


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def assert_inert(output: str, lines_at_most: int | None = None) -> None:
    for ch in CONTROLS:
        assert ch not in output, repr(output)
    assert "\nkcache: checked 0 bundles" not in output, output


def test_ls_shows_a_hostile_model_id_inert(hostile):
    result = run("ls")
    assert result.exit_code == 0
    assert_inert(result.output)
    assert "pwned" in result.output  # shown, not dropped


def test_show_shows_hostile_facts_and_paths_inert(hostile):
    _store, bundle, _fp = hostile
    result = run("show", bundle[:12], "--files")
    assert result.exit_code == 0, result.output
    assert_inert(result.output)
    assert "red" in result.output


def test_explain_shows_a_hostile_nearest_bundle_inert(hostile):
    result = run("explain", "--model", "other", "--fact", "extra.note=x")
    assert result.exit_code == 0, result.output
    assert_inert(result.output)
    assert "pwned" in result.output


def test_explain_shows_a_hostile_facts_file_inert(tmp_path, hostile):
    facts = tmp_path / "facts.json"
    facts.write_text(run("fingerprint", "--json", "--extra", f"note={EVIL}").output)
    result = run("explain", "--facts-file", str(facts))
    assert result.exit_code == 0, result.output
    assert_inert(result.output)


def test_gc_plan_shows_a_hostile_model_id_inert(hostile):
    result = run("gc", "--dry-run", "--keep-last", "0", "--older-than", "0s")
    assert result.exit_code == 0, result.output
    assert "pwned" in result.output
    assert_inert(result.output)


def test_reindex_and_verify_show_hostile_object_names_inert(hostile):
    store, _bundle, _fp = hostile
    stray = store.root / "packs" / "ab" / f"x{EVIL.replace(chr(10), '').replace('/', '')}"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"not a pack")
    result = CliRunner().invoke(main, ["reindex"], catch_exceptions=False)
    assert result.exit_code == 0, result.output + result.stderr  # a name no key can have is no object: unlisted
    assert "skipped" not in result.stderr
    assert_inert(result.output + result.stderr)
    for pack in list((store.root / "packs").rglob("*")):
        if pack.is_file() and pack != stray:
            os.unlink(pack)
    result = CliRunner().invoke(main, ["verify"], catch_exceptions=False)
    assert result.exit_code == 12
    assert_inert(result.output + result.stderr)


def test_ready_shows_a_hostile_marker_inert(tmp_path):
    """Markers under ROOT are written by whatever runs in the pod."""
    root = tmp_path / "root"
    root.mkdir()
    (root / ".kcache-state.json").write_text('{"status": "hit\\nkcache: not ready: forged", "reason": "x"}')
    (root / ".kcache-warmup.json").write_text('{"status": "ok", "seconds": 1}')
    result = run("ready", "--root", str(root))
    assert "\nkcache: not ready: forged" not in result.output, result.output
    assert_inert(result.output)


def test_the_error_boundary_prints_hostile_error_text_inert(capsys):
    """Errors quote what failed: an object key, an S3 <Message>, a value read from the store."""
    from kcache.cli.options import report
    from kcache.errors import IntegrityError

    report(IntegrityError("ref", f"refs/{EVIL}", "does not parse"), False)
    err = capsys.readouterr().err
    assert_inert(err)
    assert len(err.splitlines()) == 2, err  # the message and the hint
