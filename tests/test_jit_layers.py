"""The JIT layers of FlashInfer, DeepGEMM, CuTe DSL, torch extensions and TensorRT-LLM's autotuner.

Each is checked the same way: where it is read from (the variable, else the tool's own default),
what restore exports, what is junk, and a publish from the live directory restored under ROOT
where the exported variable points.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from trees import read_tree, write_tree

from kcache import envfile, sources
from kcache.publish import publish
from kcache.restore import restore

PY = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"

# layer, env (paths relative to the test's tmp dir), where the live dir is, the files (relative to it)
# that are carried, the junk beside them, the exported variable and where it points under ROOT.
CASES = [
    ("flashinfer", {"FLASHINFER_WORKSPACE_BASE": "ws"}, "ws/.cache/flashinfer",
     ["0.6.1/90/cached_ops/norm/norm.so", "0.6.1/90/cached_ops/norm/.ninja_log", "cubins/a.cubin"],
     ["0.6.1/90/cached_ops/norm/x.lock"], {"FLASHINFER_WORKSPACE_BASE": "flashinfer"}),
    ("flashinfer", {"HOME": "home"}, "home/.cache/flashinfer", ["90/cached_ops/norm/norm.so"], [],
     {"FLASHINFER_WORKSPACE_BASE": "flashinfer"}),
    ("deep_gemm", {"DG_JIT_CACHE_DIR": "dg"}, "dg", ["cache/kernel.fp8_gemm.ab12/kernel.cubin"],
     ["tmp/5f1e"], {"DG_JIT_CACHE_DIR": "deep_gemm", "SGLANG_DG_CACHE_DIR": "deep_gemm"}),
    ("deep_gemm", {"SGLANG_DG_CACHE_DIR": "sg"}, "sg", ["cache/kernel.m.cd/kernel.cubin"], [],
     {"DG_JIT_CACHE_DIR": "deep_gemm"}),
    ("deep_gemm", {"HOME": "home"}, "home/.deep_gemm", ["cache/kernel.m.ef/kernel.cu"], [],
     {"DG_JIT_CACHE_DIR": "deep_gemm"}),
    ("trtllm_deep_gemm", {"TRTLLM_DG_CACHE_DIR": "tdg"}, "tdg", ["cache/kernel.x.01/kernel.cubin"], [],
     {"TRTLLM_DG_CACHE_DIR": "trtllm_deep_gemm"}),
    # The fork's compiler.cuh (TensorRT-LLM's, and FlashInfer's copy): $HOME/.tensorrt_llm when the variable is unset
    ("trtllm_deep_gemm", {"HOME": "home"}, "home/.tensorrt_llm", ["cache/kernel.x.01/kernel.cubin"],
     ["tmp/kernel.x.01_5f1e"], {"TRTLLM_DG_CACHE_DIR": "trtllm_deep_gemm"}),
    ("cute_dsl", {"CUTE_DSL_CACHE_DIR": "cute"}, "cute", ["0a1b2c.mlir"], ["tmp.pid_7_abc/0a1b2c.mlir"],
     {"CUTE_DSL_CACHE_DIR": "cute_dsl"}),
    ("cute_dsl", {"TMPDIR": "t", "USER": "svc"}, "t/svc/cutlass_python_cache", ["ff.mlir"], [],
     {"CUTE_DSL_CACHE_DIR": "cute_dsl"}),
    ("torch_extensions", {"TORCH_EXTENSIONS_DIR": "ext"}, "ext", ["kc/kc.so", "kc/build.ninja", "kc/.ninja_deps"],
     ["kc/lock"], {"TORCH_EXTENSIONS_DIR": "torch_extensions"}),
    ("torch_extensions", {"HOME": "home"}, f"home/.cache/torch_extensions/{PY}_cpu", ["kc/kc.so"], [],
     {"TORCH_EXTENSIONS_DIR": "torch_extensions"}),
    ("torch_extensions", {"XDG_CACHE_HOME": "xdg"}, f"xdg/torch_extensions/{PY}_cpu", ["kc/kc.so"], [],
     {"TORCH_EXTENSIONS_DIR": "torch_extensions"}),
]  # fmt: skip


def absolute(tmp_path: Path, env: dict) -> dict:
    return {k: str(tmp_path / v) if k not in ("USER",) else v for k, v in env.items()}


@pytest.mark.parametrize("layer, env, live, carried, junk, exported", CASES,
                         ids=[f"{c[0]}-{next(iter(c[1]))}" for c in CASES])  # fmt: skip
def test_layer_is_read_from_its_live_dir_and_restored_where_its_variable_points(
    tmp_path, store, sqlite_index, fp, layer, env, live, carried, junk, exported
):
    env = absolute(tmp_path, env)
    write_tree(tmp_path / live, {rel: rel.encode() for rel in carried + junk})
    (source,) = sources.select([layer])
    assert tmp_path / live in source.live_dirs(env)
    result = publish(store, sqlite_index, fp, [source], env=env)
    assert result.files == len(carried)
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    written = envfile.read(root / envfile.NAME)
    for var, place in exported.items():
        assert written[var] == str(root / place)
    assert sorted(read_tree(source.restore_dir(root))) == sorted(carried)


def test_flashinfer_is_found_under_the_exported_workspace_base(tmp_path):
    (source,) = sources.select(["flashinfer"])
    exported = Path(source.exports(tmp_path)["FLASHINFER_WORKSPACE_BASE"])
    # FlashInfer: <FLASHINFER_WORKSPACE_BASE>/.cache/flashinfer (flashinfer/jit/env.py)
    assert source.restore_dir(tmp_path) == exported / ".cache" / "flashinfer"


def test_deep_gemm_defaults_are_merged(tmp_path):
    (source,) = sources.select(["deep_gemm"])
    home = tmp_path / "home"
    assert source.live_dirs({"HOME": str(home)}) == [home / ".cache/deep_gemm", home / ".deep_gemm"]


def test_flashinfer_cubin_dir_is_exported_only_when_restored(tmp_path, store, sqlite_index, fp):
    (source,) = sources.select(["flashinfer_cubin"])
    assert source.exports(tmp_path / "empty") == {}  # FlashInfer keeps its default, inside the workspace
    write_tree(tmp_path / "cubins", {"fmha/a.cubin": b"\x7fELF"})
    publish(store, sqlite_index, fp, [source], env={"FLASHINFER_CUBIN_DIR": str(tmp_path / "cubins")})
    restore(store, sqlite_index, fp, tmp_path / "root")
    written = envfile.read(tmp_path / "root" / envfile.NAME)
    assert written["FLASHINFER_CUBIN_DIR"] == str(tmp_path / "root/flashinfer_cubin")
    assert (tmp_path / "root/flashinfer_cubin/fmha/a.cubin").read_bytes() == b"\x7fELF"


def test_trtllm_autotuner_file_travels_under_a_fixed_name(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "tune", {"deadbeef.cache": b'{"tactics": 1}', "other.json": b"not ours"})
    (source,) = sources.select(["trtllm_autotuner"])
    env = {"TLLM_AUTOTUNER_CACHE_PATH": str(tmp_path / "tune/deadbeef.cache")}
    assert publish(store, sqlite_index, fp, [source], env=env).files == 1
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    path = Path(envfile.read(root / envfile.NAME)["TLLM_AUTOTUNER_CACHE_PATH"])
    assert path == root / "trtllm_autotuner/cache.json" and path.read_bytes() == b'{"tactics": 1}'
    # publish --from ROOT reads it back from the layout restore wrote
    again = publish(store, sqlite_index, fp, [source], root=root, env={})
    assert again.files == 1 and not again.created


def test_unset_variables_without_defaults_carry_nothing():
    for name in ("trtllm_autotuner", "flashinfer_cubin"):
        (source,) = sources.select([name])
        assert source.live_dirs({}) == []


def test_every_layer_has_its_own_restore_dir(tmp_path):
    """Two layers sharing a place under ROOT would swap each other out."""
    places = [s.restore_dir(tmp_path) for s in sources.BUILTIN]
    for i, a in enumerate(places):
        for b in places[i + 1 :]:
            assert not a.is_relative_to(b) and not b.is_relative_to(a), (a, b)


def test_cute_dsl_is_read_for_the_run_as_user(tmp_path, monkeypatch):
    """A live publish by another user than the model's (a sidecar sharing /tmp, KCACHE_RUN_AS naming the
    model's user as for the Inductor layers) read its own <user>/cutlass_python_cache, not the model's."""
    monkeypatch.setenv("KCACHE_RUN_AS", "model")
    monkeypatch.setenv("USER", "sidecar")
    (source,) = sources.select(["cute_dsl"])
    assert source.live_dirs({"TMPDIR": str(tmp_path), "USER": "sidecar"}) == [tmp_path / "model/cutlass_python_cache"]


# torch 2.13's cpp_extension._get_build_directory: py<MM><abiflags>_<rocm<hip>|cu<cuda>|cpu> under the default root
STALE_BUILDS = [
    ({"torch.version": "2.13.0+cu128", "torch.cuda": "12.8"}, f"{PY}_cu128", [f"{PY}_cu121", f"{PY}_cpu"]),
    ({"torch.version": "2.13.0+rocm6.4", "torch.hip": "6.4.43482"}, f"{PY}_rocm6443482", [f"{PY}_cu128"]),
    ({"torch.version": "2.13.0+cpu"}, f"{PY}_cpu", [f"{PY}_cu128"]),
    ({"torch.version": "2.13.0+cu128", "torch.cuda": "12.8"}, f"{PY}_cu128", ["py310_cu128", "py311t_cu128"]),
]  # fmt: skip


@pytest.mark.parametrize("torch_facts, current, stale", STALE_BUILDS, ids=[c[1] for c in STALE_BUILDS])
def test_live_publish_takes_only_the_build_folder_of_the_keyed_torch(tmp_path, store, sqlite_index, torch_facts,
                                                                     current, stale):  # fmt: skip
    """Builds of another CUDA, ROCm or Python in the default root (a kept HOME, an image upgrade) named the
    same extension: merged first-wins, a stale one could win and every restored pod rebuilt (or loaded it)."""
    from fixed_facts import FACTS

    from kcache import fingerprint

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    fp = fingerprint.compute({**FACTS, "python": py, **torch_facts})
    base = tmp_path / "home/.cache/torch_extensions"
    for folder in stale:
        write_tree(base / folder, {"kc/kc.so": b"stale " + folder.encode(), "old/old.so": b"other build"})
    write_tree(base / current, {"kc/kc.so": b"current", "kc/.ninja_log": b"# ninja log v5\n"})
    (source,) = sources.select(["torch_extensions"])
    publish(store, sqlite_index, fp, [source], env={"HOME": str(tmp_path / "home")})
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    assert {rel: data for rel, (data, _) in read_tree(source.restore_dir(root)).items()} == {
        "kc/kc.so": b"current", "kc/.ninja_log": b"# ninja log v5\n"}  # fmt: skip


class CarelessExtensions(sources.TorchExtensionsSource):
    """The layer as a kcache that did not know torch's lock file published it (or any signer's mistake)."""

    junk = sources.base.COMMON_JUNK


def test_restore_never_lays_a_build_lock_and_publish_never_carries_one(tmp_path, store, sqlite_index, fp):
    """torch's FileBaton waits, with no limit, for <build dir>/lock to go: one laid down by a restore
    kept every pod of the bundle from ever loading the extension (never ready)."""
    built = {"kc/kc.so": b"\x7fELF", "kc/build.ninja": b"rule", "kc/lock": b""}
    write_tree(tmp_path / "ext", built)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    carried = publish(store, sqlite_index, fp, [CarelessExtensions()], env=env)
    assert carried.files == 3  # the bundle holds a lock
    root = tmp_path / "root"
    result = restore(store, sqlite_index, fp, root)
    assert result.status == "hit"
    (source,) = sources.select(["torch_extensions"])
    assert sorted(read_tree(source.restore_dir(root))) == ["kc/build.ninja", "kc/kc.so"]
    # A build killed in the pod leaves its lock in ROOT; publish --from ROOT leaves it out.
    (source.restore_dir(root) / "kc/lock").write_bytes(b"")
    again = publish(store, sqlite_index, fp, [source], root=root, env={})
    assert again.files == 2
    restore(store, sqlite_index, fp, tmp_path / "root2")
    assert not (source.restore_dir(tmp_path / "root2") / "kc/lock").exists()


def test_flashinfer_torch_build_lock_is_neither_published_nor_restored(tmp_path, store, sqlite_index, fp):
    """FlashInfer up to 0.2.5 (flashinfer/jit/core.py) built each op with torch's cpp_extension.load() into
    <workspace>/cached_ops/<op>/, so torch's FileBaton sits at cached_ops/<op>/lock while a build runs (one
    killed mid-way leaves it). Carried and laid down, every pod's FlashInfer waited for it with no limit."""
    built = {"90/cached_ops/norm/norm.so": b"\x7fELF", "90/cached_ops/norm/build.ninja": b"rule",
             "90/cached_ops/norm/lock": b""}  # fmt: skip
    write_tree(tmp_path / "ws/.cache/flashinfer", built)
    (source,) = sources.select(["flashinfer"])
    env = {"FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws")}
    assert publish(store, sqlite_index, fp, [source], env=env).files == 2
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert sorted(read_tree(source.restore_dir(root))) == ["90/cached_ops/norm/build.ninja",
                                                           "90/cached_ops/norm/norm.so"]  # fmt: skip


class CarelessFlashInfer(sources.FlashInferSource):
    junk = sources.base.COMMON_JUNK


def test_restore_never_lays_a_flashinfer_build_lock(tmp_path, store, sqlite_index, fp):
    """A bundle that holds the lock anyway (an older kcache published it) is restored without it."""
    write_tree(tmp_path / "ws/.cache/flashinfer", {"90/cached_ops/norm/norm.so": b"\x7fELF",
                                                   "90/cached_ops/norm/lock": b""})  # fmt: skip
    env = {"FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws")}
    assert publish(store, sqlite_index, fp, [CarelessFlashInfer()], env=env).files == 2
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    (source,) = sources.select(["flashinfer"])
    assert sorted(read_tree(source.restore_dir(root))) == ["90/cached_ops/norm/norm.so"]


def test_trtllm_autotuner_per_rank_files_travel_beside_the_file(tmp_path, store, sqlite_index, fp):
    """TensorRT-LLM from its PR #7738 (September 2025) until ranks were merged into one file (#10336, December
    2025) loads and saves <path without extension>.rank<r>.json for TLLM_AUTOTUNER_CACHE_PATH and never
    writes the path itself: the layer carried nothing and every pod profiled every op again."""
    write_tree(tmp_path / "tune", {"deadbeef.rank0.json": b'{"r": 0}', "deadbeef.rank1.json": b'{"r": 1}',
                                   "other.rank0.json": b"not ours", "deadbeef.rank1.json.tmp": b"half",
                                   "deadbeef.rankx.json": b"no rank"})  # fmt: skip
    (source,) = sources.select(["trtllm_autotuner"])
    env = {"TLLM_AUTOTUNER_CACHE_PATH": str(tmp_path / "tune/deadbeef.cache")}
    assert publish(store, sqlite_index, fp, [source], env=env).files == 2
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    path = Path(envfile.read(root / envfile.NAME)["TLLM_AUTOTUNER_CACHE_PATH"])
    # where that TensorRT-LLM looks for them under the exported path: os.path.splitext(path)[0] + ".rank<r>.json"
    stem = str(path.with_suffix(""))
    assert Path(stem + ".rank0.json").read_bytes() == b'{"r": 0}'
    assert Path(stem + ".rank1.json").read_bytes() == b'{"r": 1}'
    assert sorted(read_tree(source.restore_dir(root))) == ["cache.rank0.json", "cache.rank1.json"]
    # publish --from ROOT reads them back from the layout restore wrote
    again = publish(store, sqlite_index, fp, [source], root=root, env={})
    assert again.files == 2 and not again.created


def test_triton_temporaries_inside_vllms_cache_are_neither_published_nor_restored(tmp_path, store, sqlite_index,
                                                                                   fp):  # fmt: skip
    """vLLM points Triton at torch_compile_cache/<hash>/rank_<i>_<j>/triton_cache, where Triton writes each file
    through <kernel>/tmp.pid_<pid>_<uuid>/ and torch's TritonBundler a kernel through tmp.<uuid4>/: what a
    killed compile left there (half-written files) was carried in the vllm layer and laid down in every pod."""
    rank = "torch_compile_cache/0123456789/rank_0_0/triton_cache"
    kernel = f"{rank}/{'ab' * 32}"
    group = json.dumps({"child_paths": {"add.cubin": str(tmp_path / "vllm" / kernel / "add.cubin")}}).encode()
    kept = {f"{kernel}/add.cubin": b"\x7fELF", f"{kernel}/__grp__add.json": group,
            "torch_compile_cache/0123456789/rank_0_0/vllm_compile_cache.py": b"{}"}  # fmt: skip
    temporaries = {f"{rank}/{'ab' * 32}/tmp.pid_41_5b0e7a52-6f5c-4c7e-9d2b-0c3e8f1a2b3c/add.ptx": b"// half",
                   f"{rank}/tmp.0f8e2a4c-1b3d-4e5f-8a9b-7c6d5e4f3a2b/add.cubin": b"\x7fEL"}  # fmt: skip
    write_tree(tmp_path / "vllm", {**kept, **temporaries})
    (source,) = sources.select(["vllm"])
    assert publish(store, sqlite_index, fp, [source], env={"VLLM_CACHE_ROOT": str(tmp_path / "vllm")}).files == 3
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert sorted(read_tree(source.restore_dir(root))) == sorted(kept)


@pytest.mark.parametrize("env, live", [({"VLLM_CACHE_ROOT": "~/vc"}, "home/vc"),
                                       ({"VLLM_CACHE_ROOT": "~"}, "home"),
                                       ({"XDG_CACHE_HOME": "~/xdg"}, "home/xdg/vllm")])  # fmt: skip
def test_vllm_cache_root_is_read_where_vllm_expands_a_tilde(tmp_path, store, sqlite_index, fp, env, live):
    """vLLM (envs.py) reads VLLM_CACHE_ROOT, and its default under XDG_CACHE_HOME, through os.path.expanduser:
    a pod spec's `~/...` (no shell expands it) had publish read ./~/... and carry nothing vLLM compiled."""
    write_tree(tmp_path / live, {"torch_compile_cache/0123456789/rank_0_0/computation_graph.py": b"# graph"})
    (source,) = sources.select(["vllm"])
    env = {**env, "HOME": str(tmp_path / "home")}
    assert source.live_dirs(env) == [tmp_path / live]
    assert publish(store, sqlite_index, fp, [source], env=env).files == 1


def test_deep_gemm_is_exported_under_every_name_its_readers_take(tmp_path):
    """SGLang until its rename (2025-10) set DG_JIT_CACHE_DIR from SGL_DG_CACHE_DIR, else ~/.cache/deep_gemm,
    whatever DG_JIT_CACHE_DIR said (and later SGLang still takes SGL_DG_CACHE_DIR over SGLANG_DG_CACHE_DIR);
    DeepGEMM until 2025-05-07 read DG_CACHE_DIR. Under those, a restored pod's DeepGEMM looked in the model's
    HOME and compiled every kernel again."""
    (source,) = sources.select(["deep_gemm"])
    place = str(source.restore_dir(tmp_path))
    exported = source.exports(tmp_path)
    for var in ("DG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "SGL_DG_CACHE_DIR", "DG_CACHE_DIR"):
        assert exported[var] == place, var


@pytest.mark.parametrize("env, live", [({"SGL_DG_CACHE_DIR": "sgl", "SGLANG_DG_CACHE_DIR": "sg"}, "sgl"),
                                       ({"SGLANG_DG_CACHE_DIR": "sg", "DG_JIT_CACHE_DIR": "dg"}, "sg"),
                                       ({"DG_CACHE_DIR": "old"}, "old"),
                                       ({"DG_JIT_CACHE_DIR": "dg", "DG_CACHE_DIR": "old"}, "dg")])  # fmt: skip
def test_deep_gemm_is_read_where_its_reader_put_it(tmp_path, env, live):
    """SGLang sets DeepGEMM's variable from its own (SGL_ over SGLANG_) at import, overriding DG_JIT_CACHE_DIR."""
    (source,) = sources.select(["deep_gemm"])
    assert source.live_dirs(absolute(tmp_path, env)) == [tmp_path / live]


def test_cute_dsl_is_read_where_a_user_without_a_name_keeps_it(tmp_path, monkeypatch):
    """A uid with no passwd entry and no USER (an OpenShift pod, a bare `runAsUser`): CuTe DSL 4.3 to 4.7
    (cutlass/base_dsl/cache_helpers.py) cannot name the user and falls back to <TMPDIR>/cutlass_python_cache;
    a live publish read <TMPDIR>/uid_<uid>/cutlass_python_cache, torch's fallback name, and carried nothing."""
    import pwd

    for var in ("USER", "USERNAME", "LOGNAME", "LNAME", "KCACHE_RUN_AS"):
        monkeypatch.delenv(var, raising=False)
    uid = 54321
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    (source,) = sources.select(["cute_dsl"])
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the uid the model runs as; the answer goes back through the pipe
        try:
            os.setuid(uid)
            os.write(write, str(source.live_dirs({"TMPDIR": str(tmp_path)})[0]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        found = answer.read().decode()
    os.waitpid(child, 0)
    assert found == str(tmp_path / "cutlass_python_cache")
