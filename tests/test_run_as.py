"""The precompiled header is laid out for the user that runs the model, not the one restoring.

torch names the header's directory torchinductor_<getpass.getuser()>; getpass reads LOGNAME/USER
first, which is how these tests play two users in one machine.
"""

import logging
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache import envfile, sources
from kcache.cli import main
from kcache.publish import publish
from kcache.restore import restore
from kcache.sources.inductor import PrecompiledHeaderSource

HEADER = "precompiled_headers/header.h.gch"


def as_user(monkeypatch, name: str) -> None:
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOGNAME", name)
    monkeypatch.delenv("KCACHE_RUN_AS", raising=False)


@pytest.fixture
def published(tmp_path, monkeypatch, store, sqlite_index, fp):
    """A header published by `modeluser` (the model's user, where warmup ran) from its live temp dir."""
    as_user(monkeypatch, "modeluser")
    write_tree(tmp_path / "pub-tmp", {f"torchinductor_modeluser/{HEADER}": b"header"})
    publish(store, sqlite_index, fp, sources.select(["inductor-pch"]), env={"TMPDIR": str(tmp_path / "pub-tmp")})
    as_user(monkeypatch, "initc")  # the init container's user
    return store, sqlite_index, fp


def test_restore_lays_the_header_out_for_the_user_publish_recorded(tmp_path, published):
    root = tmp_path / "root"
    restore(*published, root)
    assert (root / "tmp/torchinductor_modeluser" / HEADER).read_bytes() == b"header"
    assert not (root / "tmp/torchinductor_initc").exists()


def test_run_as_beats_the_record(tmp_path, published, monkeypatch):
    restore(*published, tmp_path / "a", run_as="root")
    assert (tmp_path / "a/tmp/torchinductor_root" / HEADER).is_file()
    monkeypatch.setenv("KCACHE_RUN_AS", "svc")
    restore(*published, tmp_path / "b")
    assert (tmp_path / "b/tmp/torchinductor_svc" / HEADER).is_file()


def test_run_as_flag_on_the_cli(tmp_path, monkeypatch):
    as_user(monkeypatch, "initc")
    write_tree(tmp_path / "src", {f"tmp/torchinductor_initc/{HEADER}": b"header"})  # laid out by an older restore
    runner = CliRunner()
    ok = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m"], catch_exceptions=False)
    assert ok.exit_code == 0, ok.output
    done = runner.invoke(main, ["restore", "--into", str(tmp_path / "r"), "--model", "m", "--run-as", "uid_0"],
                         catch_exceptions=False)  # fmt: skip
    assert done.exit_code == 0 and "hit" in done.output, done.output
    assert (tmp_path / "r/tmp/torchinductor_uid_0" / HEADER).is_file()


def test_a_hostile_recorded_user_is_ignored(tmp_path, monkeypatch, store, sqlite_index, fp, caplog):
    as_user(monkeypatch, "x")
    evil = "a\nb"  # a control character: no user torch could run as
    write_tree(tmp_path / "pub-tmp", {f"torchinductor_{evil}/{HEADER}": b"header"})
    publish(store, sqlite_index, fp, [PrecompiledHeaderSource(evil)], env={"TMPDIR": str(tmp_path / "pub-tmp")})
    as_user(monkeypatch, "initc")
    with caplog.at_level(logging.WARNING, logger="kcache.sources.inductor"):
        restore(store, sqlite_index, fp, tmp_path / "root")
    assert (tmp_path / "root/tmp/torchinductor_initc" / HEADER).is_file()
    assert "ignoring the recorded user" in caplog.text


def test_names_are_sanitized_as_torch_does(tmp_path, published):
    restore(*published, tmp_path / "r", run_as="dom\\user:1")
    assert (tmp_path / "r/tmp/torchinductor_dom_user_1" / HEADER).is_file()


@pytest.mark.torch
def test_the_model_process_finds_the_header_where_torch_looks(tmp_path, published):
    pytest.importorskip("torch")
    root = tmp_path / "root"
    restore(*published, root)
    env = {**os.environ, **envfile.read(root / envfile.NAME), "LOGNAME": "modeluser"}
    code = "from torch._inductor.runtime.cache_dir_utils import default_cache_dir; print(default_cache_dir())"
    looked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert os.path.isfile(os.path.join(looked.stdout.strip(), HEADER))


def test_a_live_publish_for_the_run_as_user_reads_that_users_inductor_cache(tmp_path, monkeypatch, store,
                                                                           sqlite_index, fp):  # fmt: skip
    """A publisher running as another user than the model (a sidecar sharing the model's /tmp, with
    KCACHE_RUN_AS as the example sets it on every kcache container) read the model's header but its
    own, empty torchinductor_<user>: the bundle held no graph or kernel, and every pod compiled them."""
    as_user(monkeypatch, "sidecar")
    monkeypatch.setenv("KCACHE_RUN_AS", "modeluser")
    kernels = {"fxgraph/ab/graph": b"graph", "ab/kernel.so": b"\x7fELF", "triton/0/" + "c" * 32 + "/k.cubin": b"cubin"}
    write_tree(tmp_path / "tmp/torchinductor_modeluser", {**kernels, HEADER: b"header"})
    published = publish(store, sqlite_index, fp, sources.select(["inductor", "inductor-pch", "triton"]),
                        env={"TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path / "home")})  # fmt: skip
    assert set(published.layers) == {"inductor", "inductor-pch", "triton"}
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    assert (root / "inductor/fxgraph/ab/graph").read_bytes() == b"graph"
    assert (root / "triton" / ("c" * 32) / "k.cubin").read_bytes() == b"cubin"
