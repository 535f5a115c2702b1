"""Restored caches whose index files embed absolute paths still hit (kcache.relocate).

The Triton test drives the real triton package's FileCacheManager in child processes, so the group
format is Triton's own, not a copy of it.
"""

import ast
import json
import logging
import os
import pprint
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from trees import write_tree

from kcache import relocate as relocation
from kcache import sources
from kcache.publish import publish
from kcache.relocate import Layer, known_paths, relocate
from kcache.restore import restore

KEY = "ab" * 32  # a kernel directory, named by Triton's hash

PUT = """
from triton.runtime.cache import FileCacheManager
m = FileCacheManager({key!r})
group = {{name: m.put(data, name) for name, data in
         [("add.json", '{{"name": "add"}}'), ("add.cubin", b"\\x7fELF"), ("add.ptx", "// ptx")]}}
m.put_group("add.json", group)
"""
GET = """
import json
from triton.runtime.cache import FileCacheManager
print(json.dumps(FileCacheManager({key!r}).get_group("add.json")))
"""


def triton(code: str, cache_dir: Path) -> str:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", code.format(key=KEY)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_triton_group_is_found_after_restore_into_another_directory(tmp_path, store, sqlite_index, fp):
    pytest.importorskip("triton")
    live = tmp_path / "home/.triton/cache"
    triton(PUT, live)
    published = publish(store, sqlite_index, fp, sources.select(["triton"]), env={"TRITON_CACHE_DIR": str(live)})
    shutil.rmtree(tmp_path / "home")  # the publishing machine's paths are gone, as in another pod

    root = tmp_path / "pod/cache"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    group = json.loads(triton(GET, root / "triton"))
    assert group is not None and sorted(group) == ["add.cubin", "add.json", "add.ptx"]
    assert all(Path(p).parent == root / "triton" / KEY and Path(p).is_file() for p in group.values())
    # What was published is still what the manifest says; a second restore rewrites nothing new.
    assert restore(store, sqlite_index, fp, root).bundle_id == published.bundle_id
    assert json.loads(triton(GET, root / "triton")) == group


def test_triton_groups_inside_vllms_cache_are_relocated(tmp_path, store, sqlite_index, fp):
    pytest.importorskip("triton")
    vllm_root = tmp_path / "pub/vllm"
    rank = vllm_root / "torch_compile_cache/0123456789/rank_0_0"
    triton(PUT, rank / "triton_cache")
    publish(store, sqlite_index, fp, sources.select(["vllm"]), env={"VLLM_CACHE_ROOT": str(vllm_root)})
    shutil.rmtree(tmp_path / "pub")
    root = tmp_path / "dst"
    restore(store, sqlite_index, fp, root)
    group = json.loads(triton(GET, root / "vllm/torch_compile_cache/0123456789/rank_0_0/triton_cache"))
    assert group is not None and len(group) == 3


def grp(children: dict) -> bytes:
    return json.dumps({"child_paths": children}).encode()


@pytest.mark.parametrize(
    "child",
    [
        "/etc/passwd",
        f"/pub/{KEY}/missing.cubin",
        f"/pub/{KEY}/../{KEY}/add.cubin",
        "relative/add.cubin",
        7,
        f"/pub/{KEY}/sub",
    ],
    ids=["outside", "not-in-bundle", "dotdot", "relative", "not-a-string", "a-directory"],
)
def test_a_group_naming_what_the_bundle_lacks_is_dropped_with_a_warning(tmp_path, store, sqlite_index, fp, child,
                                                                        caplog):  # fmt: skip
    name = os.path.basename(child) if isinstance(child, str) else "x"
    write_tree(tmp_path / "src", {
        f"triton/{KEY}/add.cubin": b"\x7fELF",
        f"triton/{KEY}/sub/file": b"makes sub a directory of the bundle",
        f"triton/{KEY}/__grp__add.json": grp({"add.cubin": f"/pub/{KEY}/add.cubin", name: child}),
    })  # fmt: skip
    publish(store, sqlite_index, fp, sources.select(["triton"]), root=tmp_path / "src", env={})
    with caplog.at_level(logging.WARNING, logger="kcache.relocate"):
        restore(store, sqlite_index, fp, tmp_path / "dst")
    assert not (tmp_path / f"dst/triton/{KEY}/__grp__add.json").exists()  # Triton misses and recompiles
    assert (tmp_path / f"dst/triton/{KEY}/add.cubin").read_bytes() == b"\x7fELF"
    assert "__grp__add.json" in caplog.text


def test_a_child_under_another_name_is_refused(tmp_path):
    """Triton names each child after its file; a group mapping a name onto another file is not Triton's."""
    rels = [f"{KEY}/add.cubin", f"{KEY}/__grp__add.json"]
    layer = Layer(tmp_path, tmp_path / "target", known_paths(rels), frozenset(rels))
    (tmp_path / KEY).mkdir()
    (tmp_path / KEY / "__grp__add.json").write_bytes(grp({"add.json": f"/pub/{KEY}/add.cubin"}))
    assert relocate(layer, [f"{KEY}/__grp__add.json"], ["triton-groups"]) == [f"{KEY}/__grp__add.json"]


def test_rewrite_keeps_mode_and_mtime(tmp_path):
    (tmp_path / KEY).mkdir()
    path = tmp_path / KEY / "__grp__add.json"
    path.write_bytes(grp({"add.cubin": f"/pub/{KEY}/add.cubin"}))
    os.chmod(path, 0o640)
    os.utime(path, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    rels = [f"{KEY}/add.cubin", f"{KEY}/__grp__add.json"]
    layer = Layer(tmp_path, Path("/restored/triton"), known_paths(rels), frozenset(rels))
    assert relocate(layer, [f"{KEY}/__grp__add.json"], ["triton-groups"]) == []
    assert json.loads(path.read_text()) == {"child_paths": {"add.cubin": f"/restored/triton/{KEY}/add.cubin"}}
    assert path.stat().st_mtime_ns == 1_600_000_000_123_456_789 and path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in (tmp_path / KEY).iterdir()] == ["__grp__add.json"]  # no temp file left


RANK = "torch_compile_cache/0123456789/rank_0_0/backbone"


def vllm_table(prefix: str) -> dict:
    """vLLM's handle table as CompilerManager writes it: (shape, graph index, compiler) -> handle."""
    names = {(None, 0): "artifact_shape_None_subgraph_0", (8, 1): "artifact_shape_8_subgraph_1"}
    return {(*key, "inductor_standalone"): (name, f"{prefix}/{RANK}/{name}") for key, name in names.items()}


def test_vllm_handles_point_into_the_restored_layer(tmp_path, store, sqlite_index, fp):
    files = {
        f"vllm/{RANK}/vllm_compile_cache.py": pprint.pformat(vllm_table("/root/.cache/vllm")).encode(),
        f"vllm/{RANK}/artifact_shape_None_subgraph_0": b"binary artifact",
        f"vllm/{RANK}/artifact_shape_8_subgraph_1/fxgraph/x": b"unpacked artifact",  # format="unpacked": a dir
    }
    write_tree(tmp_path / "src", files)
    publish(store, sqlite_index, fp, sources.select(["vllm"]), root=tmp_path / "src", env={})
    root = tmp_path / "dst"
    restore(store, sqlite_index, fp, root)
    table = ast.literal_eval((root / "vllm" / RANK / "vllm_compile_cache.py").read_text())
    assert table == vllm_table(str(root / "vllm"))
    assert all(Path(path).exists() for _, path in table.values())


def test_vllm_handle_to_something_not_carried_drops_the_table(tmp_path, store, sqlite_index, fp, caplog):
    write_tree(tmp_path / "src", {
        f"vllm/{RANK}/vllm_compile_cache.py": pprint.pformat(vllm_table("/root/.cache/vllm")).encode(),
        f"vllm/{RANK}/artifact_shape_None_subgraph_0": b"only one of the two artifacts",
    })  # fmt: skip
    publish(store, sqlite_index, fp, sources.select(["vllm"]), root=tmp_path / "src", env={})
    with caplog.at_level(logging.WARNING, logger="kcache.relocate"):
        restore(store, sqlite_index, fp, tmp_path / "dst")
    assert not (tmp_path / "dst/vllm" / RANK / "vllm_compile_cache.py").exists()
    assert "vllm_compile_cache.py" in caplog.text


def test_vllm_table_that_is_code_is_never_run(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x/vllm_compile_cache.py").write_text(f"__import__('os').mkdir({str(tmp_path / 'pwned')!r})")
    layer = Layer(tmp_path, tmp_path / "t", known_paths(["x/vllm_compile_cache.py"]))
    assert relocate(layer, ["x/vllm_compile_cache.py"], ["vllm-handles"]) == ["x/vllm_compile_cache.py"]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("text", ["{[]: 1}", "{'k': {{}}}", "{(1, []): ('a', '/x')}"])
def test_vllm_table_literal_python_cannot_build_is_dropped(tmp_path, caplog, text):
    """literal_eval raises TypeError for an unhashable key or set member: that table goes, the restore goes on."""
    (tmp_path / "x").mkdir()
    (tmp_path / "x/vllm_compile_cache.py").write_text(text)
    layer = Layer(tmp_path, tmp_path / "t", known_paths(["x/vllm_compile_cache.py"]))
    with caplog.at_level(logging.WARNING, logger="kcache.relocate"):
        assert relocate(layer, ["x/vllm_compile_cache.py"], ["vllm-handles"]) == ["x/vllm_compile_cache.py"]
    assert not (tmp_path / "x/vllm_compile_cache.py").exists()
    assert "unhashable" in caplog.text


@pytest.mark.parametrize("value", ["1e999", "-1e999", "(1e999, 2)"])
def test_vllm_table_the_rewrite_could_not_write_back_as_a_literal_is_dropped(tmp_path, value):
    """A float past the range literal_eval builds as inf: written back by repr it is `inf`, which vLLM's
    literal_eval refuses at start-up, every start. A rewritten table must read back as what was meant."""
    (tmp_path / "x").mkdir()
    text = "{(None, 0, 'inductor_standalone'): ('a', '/pub/x/a'), ('other', 1): " + value + "}"
    (tmp_path / "x/vllm_compile_cache.py").write_text(text)
    rels = ["x/a", "x/vllm_compile_cache.py"]
    layer = Layer(tmp_path, tmp_path / "t", known_paths(rels), frozenset(rels))
    dropped = relocate(layer, ["x/vllm_compile_cache.py"], ["vllm-handles"])
    path = tmp_path / "x/vllm_compile_cache.py"
    if not dropped:  # vLLM reads it back with literal_eval
        ast.literal_eval(path.read_text())
    else:
        assert dropped == ["x/vllm_compile_cache.py"] and not path.exists()


@pytest.mark.parametrize("extra, kept", [(0, True), (2, False)])
def test_vllm_table_past_the_token_cap_is_dropped_unparsed(tmp_path, monkeypatch, caplog, extra, kept):
    """literal_eval builds the whole AST first (~470 bytes a token): the tokens are counted before."""
    from kcache import relocate as relocation

    monkeypatch.setattr(relocation, "_MAX_TABLE_TOKENS", 1000)
    (tmp_path / "x").mkdir()
    # { "k" : [ 0 , ... ] } NEWLINE ENDMARKER: 8 tokens around 2 a zero
    (tmp_path / "x/vllm_compile_cache.py").write_text('{"k": [' + "0," * (496 + extra // 2) + "]}")
    layer = Layer(tmp_path, tmp_path / "t", known_paths(["x/vllm_compile_cache.py"]))
    with caplog.at_level(logging.WARNING, logger="kcache.relocate"):
        dropped = relocate(layer, ["x/vllm_compile_cache.py"], ["vllm-handles"])
    assert dropped == ([] if kept else ["x/vllm_compile_cache.py"])
    assert (tmp_path / "x/vllm_compile_cache.py").exists() == kept
    assert kept or "over 1000 tokens" in caplog.text


def test_vllm_table_of_thousands_of_handles_is_relocated(tmp_path):
    """The token cap leaves room for a large model (127 pieces) compiled for 20 sizes: 2,540 handles."""
    table = {(size, piece, "inductor_standalone"): (f"artifact_shape_{size}_subgraph_{piece}",
                                                    f"/pub/{RANK}/artifact_shape_{size}_subgraph_{piece}")
             for size in range(20) for piece in range(127)}  # fmt: skip
    index = f"{RANK}/vllm_compile_cache.py"
    rels = [f"{RANK}/{name}" for name, _ in table.values()] + [index]
    write_tree(tmp_path, {index: pprint.pformat(table, indent=4).encode()})  # as CompilerManager writes it
    layer = Layer(tmp_path, Path("/restored/vllm"), known_paths(rels), frozenset(rels))
    assert relocate(layer, [index], ["vllm-handles"]) == []
    moved = ast.literal_eval((tmp_path / index).read_text())
    assert moved[(19, 126, "inductor_standalone")][1] == f"/restored/vllm/{RANK}/artifact_shape_19_subgraph_126"


def test_a_path_of_many_components_is_judged_by_its_last_ones_and_logged_clipped(tmp_path, caplog, monkeypatch):
    """A group naming a path of 80k components took 47 s (every suffix joined) and was logged whole:
    only the last MAX_PATH_COMPONENTS can match a manifest path, and a log line stays one short line."""
    from kcache import relocate as relocation

    joined = []
    real_join = str.join

    class Counting(str):
        def join(self, parts):
            joined.append(1)
            return real_join(self, parts)

    monkeypatch.setattr(relocation, "_SEP", Counting("/"))
    long_path = "/" + "/".join(["d"] * 20_000) + "/k/add.cubin"
    layer = Layer(tmp_path, Path("/restored/triton"), known_paths(["k/add.cubin"]), frozenset({"k/add.cubin"}))
    assert layer.mapped(long_path, file=True) == "/restored/triton/k/add.cubin"
    assert len(joined) <= 300
    (tmp_path / "k").mkdir()
    (tmp_path / "k/__grp__add.json").write_text(json.dumps({"child_paths": {"add.cubin": "/x" * 20_000}}))
    with caplog.at_level(logging.WARNING, logger="kcache.relocate"):
        assert relocate(layer, ["k/__grp__add.json"], ["triton-groups"]) == ["k/__grp__add.json"]
    assert max(len(r.getMessage()) for r in caplog.records) < 1000


def test_a_handle_of_a_million_components_is_judged_in_bounded_memory(tmp_path):
    """A vLLM table at its 4 MiB cap whose one handle is `/ab` 1.4M times: mapping it built every
    component as a string (~99 MiB, on top of a restore at ~200 MiB with a manifest at the cap from S3:
    301 MiB, past its 256 MiB bound); only the last MAX_PATH_COMPONENTS can match."""
    index = f"{RANK}/vllm_compile_cache.py"
    handle = "/ab" * ((relocation._MAX_INDEX_BYTES - 128) // 3) + f"/{RANK}/artifact"
    write_tree(tmp_path, {index: repr({"k": ("artifact", handle)}).encode()})
    rels = [f"{RANK}/artifact", index]
    layer = Layer(tmp_path, Path("/restored/vllm"), known_paths(rels), frozenset(rels))
    tracemalloc.start()
    try:
        assert relocate(layer, [index], ["vllm-handles"]) == []
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ast.literal_eval((tmp_path / index).read_text())["k"][1] == f"/restored/vllm/{RANK}/artifact"
    assert peak < 40 * 1024 * 1024, f"relocation peaked at {peak / 2**20:.0f} MiB"


def test_a_group_file_whose_temp_name_is_too_long_is_dropped_not_the_restore(tmp_path, store, sqlite_index, fp):
    """A group file named near NAME_MAX (255 bytes) has no room for the rewrite's temp sibling
    (`.tmp-<name>-XXXXXXXX`): that one index file is dropped, as any it cannot rewrite is, and the
    rest of the bundle is restored (ENAMETOOLONG had failed the whole restore: a cold start)."""
    name = "__grp__" + "k" * 240 + ".json"
    write_tree(tmp_path / "src", {
        f"triton/{KEY}/add.cubin": b"\x7fELF",
        f"triton/{KEY}/{name}": grp({"add.cubin": f"/pub/{KEY}/add.cubin"}),
    })  # fmt: skip
    publish(store, sqlite_index, fp, sources.select(["triton"]), root=tmp_path / "src", env={})
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    assert (tmp_path / f"dst/triton/{KEY}/add.cubin").read_bytes() == b"\x7fELF"
    assert not (tmp_path / f"dst/triton/{KEY}/{name}").exists()  # Triton misses and recompiles the kernel


def test_triton_cache_under_triton_home_is_published_and_found_after_restore(tmp_path, store, sqlite_index, fp):
    """Triton puts its cache under $TRITON_HOME/.triton/cache when TRITON_CACHE_DIR is unset (knobs.cache
    in 3.9); publish looked under $HOME only, and the bundle left out every kernel the pod compiled."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "TORCHINDUCTOR_"))}
    env.update(HOME=str(tmp_path / "home"), TRITON_HOME=str(tmp_path / "triton-home"),
               TMPDIR=str(tmp_path / "tmp"))  # fmt: skip
    code = PUT.format(key=KEY) + "print(m.cache_dir)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "triton-home/.triton/cache" / KEY)  # where Triton itself put it
    publish(store, sqlite_index, fp, sources.select(["triton"]), env=env)
    shutil.rmtree(tmp_path / "triton-home")
    root = tmp_path / "pod"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    group = json.loads(triton(GET, root / "triton"))
    assert group is not None and sorted(group) == ["add.cubin", "add.json", "add.ptx"]


def test_triton_group_written_under_a_relative_cache_dir_is_found_after_restore(tmp_path, store, sqlite_index, fp):
    """TRITON_CACHE_DIR=triton-cache (relative, as a compose file or a shell may set it): Triton names a
    group's children by that relative path (FileCacheManager.put returns os.path.join(dir, key, name)).
    Restore dropped every such group as naming nothing of the bundle, and the pod compiled every kernel."""
    pytest.importorskip("triton")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": "triton-cache"}
    done = subprocess.run([sys.executable, "-c", PUT.format(key=KEY)], env=env, cwd=work, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    group = json.loads((work / "triton-cache" / KEY / "__grp__add.json").read_text())
    assert group["child_paths"]["add.cubin"] == f"triton-cache/{KEY}/add.cubin"  # Triton's own, relative
    publish(store, sqlite_index, fp, sources.select(["triton"]), env={"TRITON_CACHE_DIR": str(work / "triton-cache")})
    root = tmp_path / "pod"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    restored = json.loads(triton(GET, root / "triton"))
    assert restored is not None and sorted(restored) == ["add.cubin", "add.json", "add.ptx"]
    assert all(Path(p).parent == root / "triton" / KEY for p in restored.values())
