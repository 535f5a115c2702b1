"""Reuse per layer (`restore --fallback layers`): each layer keyed by only the facts it depends on.

The wrong-hit tests change, one at a time, every fact in a layer's set and check that the layer is
not reused; the right-hit tests change facts outside it and check that it is.
"""

import json
import os
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from fixed_facts import FACTS
from trees import write_tree

from kcache import canonical, explain, fingerprint, layerkeys, probes, refs, signing, sources
from kcache import manifest as manifests
from kcache.cli import main
from kcache.errors import ConfigError
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.sources.base import torch_user
from kcache.store import manifest_key, ref_key
from kcache.yank import yank

GPU = {**FACTS, "gpu.name": "NVIDIA H200", "gpu.sm": "sm_90", "gpu.count": "1", "gpu.driver": "550.54",
       "triton.version": "3.9.0", "libc": "glibc 2.36",
       # what this machine shows: a facts file that contradicts it is refused (kcache/probes.py CHECKS)
       "arch": probes.probe_platform({})["arch"], "cpu.features": probes.probe_cpu({})["cpu.features"]}  # fmt: skip
TREE = {
    "triton/k1/add.cubin": b"triton kernel",
    "cuda/index": b"driver jit index",
    "deep_gemm/cache/kernel.m.ab/kernel.cubin": b"deep gemm",
    "cute_dsl/ff.mlir": b"cute",
    "inductor/fxgraph/g": b"graph",
    f"tmp/torchinductor_{torch_user()}/precompiled_headers/h.gch": b"header",
    "vllm/torch_compile_cache/h/rank_0_0/x.py": b"vllm",
}
ALL = sources.select()


def published(tmp_path, store, index, facts, tree=TREE, name="src", **kw):
    write_tree(tmp_path / name, tree)
    return publish(store, index, fingerprint.compute(facts), ALL, root=tmp_path / name, env={}, **kw)


def restored_layers(store, index, facts, root, **kw):
    result = restore(store, index, fingerprint.compute(facts), root, fallback="layers", **kw)
    return result, {layer for layer, _ in result.donors}


@pytest.mark.parametrize("fact, value, split", [
    # g++'s search paths change the C++ Inductor builds: its layers split; Triton's launchers are
    # built with Triton's own -I/-L first and keyed by Triton, DeepGEMM's kernels by their compiler.
    ("env.CPATH", "/opt/inc", {"inductor", "inductor-pch"}),
    ("env.LIBRARY_PATH", "", {"inductor", "inductor-pch"}),
    # a debug Python is another ABI for every layer that holds Python-built code
    ("python", GPU["python"] + "d", {"inductor", "inductor-pch", "triton", "cute_dsl"}),
    # nvcc adds these flags to every command line, and runs that host compiler: DeepGEMM keys its
    # kernels by its own flags and nvcc's major.minor only, so they must split its layer too
    ("env.NVCC_APPEND_FLAGS", "--use_fast_math", {"inductor", "inductor-pch", "deep_gemm"}),
    ("env.NVCC_PREPEND_FLAGS", "-DNDEBUG", {"inductor", "inductor-pch", "deep_gemm"}),
    ("env.NVCC_CCBIN", "g++-11", {"inductor", "inductor-pch", "deep_gemm"}),
    ("env.PTXAS_FLAGS", "-O0", {"inductor", "inductor-pch", "deep_gemm"}),  # nvcc.profile passes it to ptxas
    # Triton builds from the override files but files the kernel under its usual key
    ("env.TRITON_KERNEL_OVERRIDE", "1", {"inductor", "inductor-pch", "triton"}),
    ("env.TRITON_SWAP_MIR", "/mir", {"inductor", "inductor-pch", "triton"}),
])  # fmt: skip
def test_which_layer_keys_the_new_facts_split(fact, value, split):
    other, key = {**GPU, fact: value}, layerkeys.layer_key
    changed = {layer for layer in layerkeys.FACTS if key(layer, GPU) != key(layer, other)}
    assert changed == split


TRITON_KERNEL = """
import sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def scale(x, o, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(o + i, tl.load(x + i, mask=i < n) * 3.0, mask=i < n)

src = ASTSource(fn=scale, signature={"x": "*fp32", "o": "*fp32", "n": "i32", "B": "constexpr"}, constexprs={"B": 64})
triton.compile(src, target=GPUTarget("cuda", 90, 32))  # no GPU needed: Triton's own ptxas builds the cubin
"""


def _triton_kernel_built(tmp_path):
    """(build, its own build, the folder of its dumped IR): `build(cache, **env)` compiles TRITON_KERNEL with
    the installed triton in a child process, into cache dir `cache`, and gives (its folder's name, cubin)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    (tmp_path / "k.py").write_text(TRITON_KERNEL)
    base = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}

    def build(cache, **env):
        subprocess.run([sys.executable, "k.py"], cwd=tmp_path, env={**base, "TRITON_CACHE_DIR": str(tmp_path / cache),
                       **env}, check=True, capture_output=True)  # fmt: skip
        (folder,) = (tmp_path / cache).iterdir()
        return folder.name, (folder / "scale.cubin").read_bytes()

    own = build("own", TRITON_KERNEL_DUMP="1", TRITON_DUMP_DIR=str(tmp_path / "dump"))
    (dumped,) = (tmp_path / "dump").iterdir()
    return build, own, dumped


def test_triton_files_an_overridden_kernel_under_its_usual_key_so_the_layer_key_holds_the_switch(tmp_path):
    """Measured with the installed triton (no GPU: it compiles for sm_90 with its own ptxas): with
    TRITON_KERNEL_OVERRIDE=1 it builds a kernel from the override folder's PTX (x * 5.0, not x * 3.0)
    and files it in the cache folder the kernel's own build uses. A Triton layer from such a pod,
    laid down by --fallback layers where no override is set, ran the other kernel."""
    build, own, dumped = _triton_kernel_built(tmp_path)
    ptx = (dumped / "scale.ptx").read_text()
    assert "0f40400000" in ptx  # 3.0
    (tmp_path / "override" / dumped.name).mkdir(parents=True)
    (tmp_path / "override" / dumped.name / "scale.ptx").write_text(ptx.replace("0f40400000", "0f40A00000"))  # 5.0
    overridden = build("overridden", TRITON_KERNEL_OVERRIDE="1", TRITON_OVERRIDE_DIR=str(tmp_path / "override"))
    assert own[0] == overridden[0] and own[1] != overridden[1]
    overriding = {**GPU, "env.TRITON_KERNEL_OVERRIDE": "1"}
    assert layerkeys.layer_key("triton", GPU) != layerkeys.layer_key("triton", overriding)


def test_two_pods_overriding_triton_kernels_with_other_files_share_no_key(tmp_path):
    """Both pods set TRITON_KERNEL_OVERRIDE=1; their override folders hold other PTX (x * 5.0 and x * 7.0).
    The installed triton builds two cubins and files both under the kernel's own folder name, and the
    switch alone was keyed: the pods shared their bundle key and the Triton layer's, and one ran the
    other's kernels. The folder's content is a fact now, its place is not (replicas mount it anywhere)."""
    build, _own, dumped = _triton_kernel_built(tmp_path)
    ptx = (dumped / "scale.ptx").read_text()
    pods = {}
    for pod, constant in (("five", "0f40A00000"), ("seven", "0f40E00000"), ("five-again", "0f40A00000")):
        (tmp_path / pod / dumped.name).mkdir(parents=True)
        (tmp_path / pod / dumped.name / "scale.ptx").write_text(ptx.replace("0f40400000", constant))
        env = {"TRITON_KERNEL_OVERRIDE": "1", "TRITON_OVERRIDE_DIR": str(tmp_path / pod)}
        facts = {**GPU, **probes.probe_settings(env), **probes.probe_triton_files(env)}
        pods[pod] = (build(f"cache-{pod}", **env), facts)
    (five_folder, five_cubin), five = pods["five"]
    (seven_folder, seven_cubin), seven = pods["seven"]
    assert five_folder == seven_folder and five_cubin != seven_cubin  # what triton does
    assert fingerprint.compute(five).bundle_key != fingerprint.compute(seven).bundle_key
    assert layerkeys.layer_key("triton", five) != layerkeys.layer_key("triton", seven)
    (_, again_cubin), again = pods["five-again"]
    assert again_cubin == five_cubin and fingerprint.compute(again).bundle_key == fingerprint.compute(five).bundle_key


def test_triton_override_files_are_keyed_only_where_the_switch_is_on(tmp_path):
    (tmp_path / ".triton/override/k").mkdir(parents=True)
    (tmp_path / ".triton/override/k/scale.ptx").write_text("ptx")
    assert probes.probe_triton_files({"HOME": str(tmp_path)}) == {}
    assert probes.probe_triton_files({"HOME": str(tmp_path), "TRITON_KERNEL_OVERRIDE": "0"}) == {}
    on = probes.probe_triton_files({"HOME": str(tmp_path), "TRITON_KERNEL_OVERRIDE": "yes"})
    assert on["triton.override_files"] not in ("", "absent")  # the default folder, under HOME
    elsewhere = probes.probe_triton_files({"TRITON_HOME": str(tmp_path / "none"), "TRITON_KERNEL_OVERRIDE": "1"})
    assert elsewhere == {"triton.override_files": "absent"}
    (tmp_path / ".triton/override/k/scale.ptx").write_text("other ptx")
    assert probes.probe_triton_files({"HOME": str(tmp_path), "TRITON_KERNEL_OVERRIDE": "1"}) != on
    for relative in ("", "override"):  # read from the model's working directory, which kcache cannot see
        with pytest.raises(ConfigError, match="TRITON_OVERRIDE_DIR"):
            probes.probe_triton_files({"TRITON_OVERRIDE_DIR": relative, "TRITON_KERNEL_OVERRIDE": "1"})
    (tmp_path / "mir").mkdir()
    (tmp_path / "mir/k.txt").write_text("mir")
    swapped = probes.probe_triton_files({"TRITON_SWAP_MIR": str(tmp_path / "mir")})
    (tmp_path / "mir/k.txt").write_text("other mir")
    assert probes.probe_triton_files({"TRITON_SWAP_MIR": str(tmp_path / "mir")}) != swapped
    assert "override files" in explain.reason("triton.override_files")  # not "its version"

def test_a_layer_key_without_the_facts_only_some_machines_have_is_what_it_was():
    """Facts keyed only where set (nvcc's settings) leave every other machine's layer keys as they were."""
    chosen = {"gpu.sm": GPU["gpu.sm"], "os": GPU["os"], "arch": GPU["arch"]}
    assert layerkeys.layer_key("deep_gemm", GPU) == canonical.xxh3({"schema": 1, "layer": "deep_gemm", "facts": chosen})
    chosen = {name: GPU[name] for name in ("triton.version", "gpu.sm", "os", "arch", "python", "libc")}
    assert layerkeys.layer_key("triton", GPU) == canonical.xxh3({"schema": 1, "layer": "triton", "facts": chosen})


def test_a_driver_upgrade_keeps_the_kernel_layers_but_not_the_jit_cache(tmp_path, store, sqlite_index):
    pub = published(tmp_path, store, sqlite_index, GPU)
    upgraded = {**GPU, "gpu.driver": "560.28"}
    assert restore(store, sqlite_index, fingerprint.compute(upgraded), tmp_path / "plain").status == "miss"
    result, reused = restored_layers(store, sqlite_index, upgraded, tmp_path / "r")
    assert result.status == "partial" and reused == {"triton", "deep_gemm", "cute_dsl"}
    assert dict(result.donors)["triton"] == pub.bundle_id and "triton from" in result.reason
    assert (tmp_path / "r/triton/k1/add.cubin").read_bytes() == b"triton kernel"
    assert not any((tmp_path / "r/cuda").iterdir()) and not any((tmp_path / "r/inductor").iterdir())


def test_a_new_model_reuses_every_reusable_layer_but_not_vllms(tmp_path, store, sqlite_index):
    published(tmp_path, store, sqlite_index, GPU)
    result, reused = restored_layers(store, sqlite_index, {**GPU, "model.id": "other-model"}, tmp_path / "r")
    assert reused == set(layerkeys.FACTS) and "vllm" not in result.layers
    assert (tmp_path / f"r/tmp/torchinductor_{torch_user()}/precompiled_headers/h.gch").read_bytes() == b"header"
    assert not (tmp_path / "r/vllm/torch_compile_cache").exists()


WRONG = [(layer, fact) for layer, chosen in layerkeys.FACTS.items() if chosen != layerkeys.TOOLCHAIN
         for fact in chosen] + [(layer, fact) for layer in ("inductor", "inductor-pch")
                                for fact in ("cpu.isa", "torch.version", "cxx.name", "gpu.sm")]  # fmt: skip


@pytest.mark.parametrize("layer, fact", WRONG, ids=[f"{a}-{b}" for a, b in WRONG])
def test_a_fact_in_the_layers_set_stops_its_reuse(tmp_path, store, sqlite_index, layer, fact):
    published(tmp_path, store, sqlite_index, GPU)
    _, reused = restored_layers(store, sqlite_index, {**GPU, fact: GPU.get(fact, "none") + "-changed"}, tmp_path / "r")
    assert layer not in reused


def test_the_newest_matching_bundle_gives_the_layer(tmp_path, store, sqlite_index):
    published(tmp_path, store, sqlite_index, {**GPU, "model.id": "a"}, {"triton/k1/add.cubin": b"old"}, "a")
    newer = published(tmp_path, store, sqlite_index, {**GPU, "model.id": "b"}, {"triton/k1/add.cubin": b"new"}, "b")
    result, _ = restored_layers(store, sqlite_index, {**GPU, "model.id": "c"}, tmp_path / "r")
    assert dict(result.donors)["triton"] == newer.bundle_id
    assert (tmp_path / "r/triton/k1/add.cubin").read_bytes() == b"new"


def test_a_yanked_donor_gives_nothing(tmp_path, store, sqlite_index):
    pub = published(tmp_path, store, sqlite_index, GPU)
    store.put_bytes(refs.yank_key(pub.bundle_id), b"bad kernels")
    result, reused = restored_layers(store, sqlite_index, {**GPU, "model.id": "other"}, tmp_path / "r")
    assert result.status == "miss" and reused == set()


def test_a_ref_to_a_bundle_whose_facts_do_not_give_the_key_is_ignored(tmp_path, store, sqlite_index):
    """Whoever can write refs/ cannot steer another toolchain's kernels into our layer."""
    other = {**GPU, "gpu.sm": "sm_80", "gpu.name": "NVIDIA A100"}
    pub = published(tmp_path, store, sqlite_index, other)
    ours = {**GPU, "model.id": "victim"}
    key = layerkeys.layer_key("triton", ours)
    forged = refs.Ref(layerkeys.ref_name("triton", key), pub.bundle_id, datetime.now(timezone.utc) + timedelta(1))
    assert refs.advance(store, forged)
    result, reused = restored_layers(store, sqlite_index, ours, tmp_path / "r")
    assert "triton" not in reused and not (tmp_path / "r/triton/k1").exists()


def test_an_unsigned_donor_is_refused_when_signatures_are_required(tmp_path, store, sqlite_index):
    _, public = signing.generate("team", tmp_path / "keys")
    published(tmp_path, store, sqlite_index, GPU)
    trusted = signing.load_trusted_keys([public])
    result, reused = restored_layers(store, sqlite_index, {**GPU, "model.id": "x"}, tmp_path / "r",
                                     trusted=trusted, require_signature=True)  # fmt: skip
    assert result.status == "miss" and reused == set()


def test_a_signed_donor_is_taken(tmp_path, store, sqlite_index):
    private, public = signing.generate("team", tmp_path / "keys")
    published(tmp_path, store, sqlite_index, GPU, config=PublishConfig(signing_key=signing.load_signing_key(private)))
    trusted = signing.load_trusted_keys([public])
    _, reused = restored_layers(store, sqlite_index, {**GPU, "model.id": "x"}, tmp_path / "r",
                                trusted=trusted, require_signature=True)  # fmt: skip
    assert "triton" in reused


def test_the_manifest_records_each_layer_key(tmp_path, store, sqlite_index):
    pub = published(tmp_path, store, sqlite_index, GPU)
    manifest = manifests.parse(store.get_bytes(manifest_key(pub.bundle_id)), pub.bundle_id)
    for layer in layerkeys.FACTS:
        assert manifest.layer_info[layer]["key"] == layerkeys.layer_key(layer, GPU)
    assert "key" not in manifest.layer_info.get("vllm", {})


def test_cli_reports_where_each_layer_came_from(tmp_path, monkeypatch):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"facts": GPU}))
    write_tree(tmp_path / "src", TREE)
    runner = CliRunner()
    args = ["--facts-file", str(facts), "--json"]
    pub = json.loads(runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), *args],
                                   catch_exceptions=False).output)  # fmt: skip
    restore_args = ["restore", "--into", str(tmp_path / "r"), "--fallback", "layers", "--fact", "gpu.driver=9"]
    moved = json.loads(runner.invoke(main, restore_args + args, catch_exceptions=False).output)
    assert moved["status"] == "partial" and moved["donors"]["triton"] == pub["bundle_id"]


def test_explain_gives_a_verdict_per_layer(tmp_path, store, sqlite_index):
    pub = published(tmp_path, store, sqlite_index, GPU)
    verdicts = {v.layer: v for v in layerkeys.verdicts({**GPU, "gpu.driver": "560"}, sqlite_index.list_bundles())}
    assert verdicts["triton"].donor == pub.bundle_id and "reusable" in verdicts["triton"].verdict
    assert verdicts["cuda"].donor is None and verdicts["cuda"].differing == ("gpu.driver",)
    assert "gpu.driver" in verdicts["cuda"].verdict


@pytest.mark.parametrize("fact, value, kept, split", [
    # DeepGEMM's own key holds its flags and nvcc's major.minor, not what nvcc reads from the environment
    ("env.NVCC_APPEND_FLAGS", "--use_fast_math", "triton", "deep_gemm"),
    # Triton files a kernel built from override files under its own build's key
    ("env.TRITON_KERNEL_OVERRIDE", "1", "deep_gemm", "triton"),
])  # fmt: skip
def test_a_layer_built_under_a_setting_its_engine_does_not_key_is_not_reused(tmp_path, store, sqlite_index, fact,
                                                                            value, kept, split):  # fmt: skip
    """A kernel built under the setting must not be laid down for a pod without it, nor the reverse."""
    pub = published(tmp_path, store, sqlite_index, GPU)
    flagged = {**GPU, fact: value}
    _, donors = restored_layers(store, sqlite_index, flagged, tmp_path / "r")
    assert kept in donors and split not in donors
    verdicts = {v.layer: v for v in layerkeys.verdicts(flagged, sqlite_index.list_bundles())}
    assert verdicts[kept].donor == pub.bundle_id
    assert verdicts[split].donor is None and verdicts[split].differing == (fact,)


def test_explain_names_the_donor_restore_would_take_not_an_older_bundle(tmp_path, store, sqlite_index):
    """Restore takes a layer from the newest bundle of the key its ref names: an older bundle of that
    key holding the layer is no donor once a newer one without it is published."""
    older = published(tmp_path, store, sqlite_index, GPU, tree={"triton/k1/add.cubin": b"t", "inductor/g": b"g"})
    published(tmp_path, store, sqlite_index, GPU, tree={"inductor/g": b"other"}, name="later")
    other_model = {**GPU, "model.id": "another-model"}
    result, reused = restored_layers(store, sqlite_index, other_model, tmp_path / "r")
    assert "triton" not in reused
    verdict = {v.layer: v for v in layerkeys.verdicts(other_model, sqlite_index.list_bundles())}["triton"]
    assert verdict.donor is None and older.bundle_id[:12] in verdict.verdict and "newest" in verdict.verdict


def test_explain_cli_lists_layers_on_a_miss(tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"facts": GPU}))
    write_tree(tmp_path / "src", TREE)
    runner = CliRunner()
    runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--facts-file", str(facts)],
                  catch_exceptions=False)  # fmt: skip
    out = runner.invoke(main, ["explain", "--facts-file", str(facts), "--fact", "gpu.driver=9", "--json"],
                        catch_exceptions=False)  # fmt: skip
    layers = {v["layer"]: v for v in json.loads(out.output)["layers"]}
    assert layers["triton"]["donor"] and layers["cuda"]["differing"] == ["gpu.driver"]
    text = runner.invoke(main, ["explain", "--facts-file", str(facts), "--fact", "gpu.driver=9"]).output
    assert "per layer" in text and "reusable from bundle" in text


# ---- a store writer without the key, against pods that require signatures --------------------------


def _signed(tmp_path):
    private, public = signing.generate("team", tmp_path / "keys")
    return PublishConfig(signing_key=signing.load_signing_key(private)), signing.load_trusted_keys([public])


def _point_layer_ref(store, layer, facts, bundle_id):
    """What a store writer can do: overwrite refs/layers/<layer>/<key> (they are not signed)."""
    name = layerkeys.ref_name(layer, layerkeys.layer_key(layer, facts))
    store.delete(ref_key(name))
    assert store.put_bytes(ref_key(name), refs.Ref(name, bundle_id, datetime.now(timezone.utc)).to_bytes())


@pytest.mark.parametrize("mode", ["refs", "index"])
def test_a_layer_ref_put_back_on_a_yanked_signed_bundle_gives_nothing(tmp_path, store, sqlite_index, mode):
    from kcache.yank import yank

    config, trusted = _signed(tmp_path)
    bad = published(tmp_path, store, sqlite_index, {**GPU, "model.id": "a"}, {"triton/k1/add.cubin": b"NaN"}, "a",
                    config=config)  # fmt: skip
    yank(store, sqlite_index, bad.bundle_id, "NaNs", signer=config.signing_key)
    published(tmp_path, store, sqlite_index, {**GPU, "model.id": "b"}, {"triton/k1/add.cubin": b"good"}, "b",
              config=config)  # fmt: skip
    victim = {**GPU, "model.id": "c"}
    _point_layer_ref(store, "triton", victim, bad.bundle_id)
    store.delete(refs.yank_key(bad.bundle_id))
    catalog = refs.RefCatalog(store) if mode == "refs" else sqlite_index
    result, _ = restored_layers(store, catalog, victim, tmp_path / "r", trusted=trusted, require_signature=True)
    assert dict(result.donors).get("triton") != bad.bundle_id
    kernel = tmp_path / "r/triton/k1/add.cubin"
    assert not kernel.exists() or kernel.read_bytes() != b"NaN"


def test_a_layer_ref_put_back_on_an_older_signed_bundle_takes_the_newest_of_that_key(tmp_path, store, sqlite_index):
    config, trusted = _signed(tmp_path)
    facts = {**GPU, "model.id": "a"}
    old = published(tmp_path, store, sqlite_index, facts, {"triton/k1/add.cubin": b"old"}, "old", config=config)
    new = published(tmp_path, store, sqlite_index, facts, {"triton/k1/add.cubin": b"new"}, "new", config=config)
    assert old.bundle_id != new.bundle_id
    victim = {**GPU, "model.id": "c"}
    _point_layer_ref(store, "triton", victim, old.bundle_id)
    result, _ = restored_layers(store, refs.RefCatalog(store), victim, tmp_path / "r", trusted=trusted,
                                require_signature=True)  # fmt: skip
    assert dict(result.donors)["triton"] == new.bundle_id
    assert (tmp_path / "r/triton/k1/add.cubin").read_bytes() == b"new"


def test_an_unsigned_donor_manifest_is_never_read_when_signatures_are_required(tmp_path, store, sqlite_index,
                                                                                monkeypatch):  # fmt: skip
    _, trusted = _signed(tmp_path)
    published(tmp_path, store, sqlite_index, GPU)  # unsigned: a store writer's
    read = []
    real = manifests.parse
    monkeypatch.setattr(manifests, "parse", lambda data, *a, **kw: read.append(len(data)) or real(data, *a, **kw))
    result, reused = restored_layers(store, refs.RefCatalog(store), {**GPU, "model.id": "x"}, tmp_path / "r",
                                     trusted=trusted, require_signature=True)  # fmt: skip
    assert result.status == "miss" and reused == set() and read == []


def test_one_donor_of_every_layer_is_read_once(tmp_path, store, sqlite_index, monkeypatch):
    published(tmp_path, store, sqlite_index, GPU)
    read = []
    real = manifests.parse
    monkeypatch.setattr(manifests, "parse", lambda data, *a, **kw: read.append(len(data)) or real(data, *a, **kw))
    _, reused = restored_layers(store, sqlite_index, {**GPU, "model.id": "other"}, tmp_path / "r")
    assert reused == set(layerkeys.FACTS) and len(read) == 1


def test_donor_manifests_together_stay_within_the_manifest_cap(tmp_path, store, sqlite_index, monkeypatch):
    """Each layer may come from another bundle: what they weigh together is what restore holds."""
    a = published(tmp_path, store, sqlite_index, {**GPU, "gpu.driver": "1"}, TREE, "a")
    b = published(tmp_path, store, sqlite_index, {**GPU, "triton.version": "9"}, TREE, "b")
    sizes = [store.size(manifest_key(x.bundle_id)) for x in (a, b)]
    monkeypatch.setenv("KCACHE_MAX_MANIFEST_BYTES", str(max(sizes) + min(sizes) // 2))
    # triton and cute_dsl key on triton.version / python only: from a; cuda, the toolchain layers: ...
    victim = {**GPU, "gpu.driver": "1", "triton.version": "9"}
    result, reused = restored_layers(store, sqlite_index, victim, tmp_path / "r")
    donors = {bundle for _, bundle in result.donors}
    assert len(donors) == 1 and reused


@pytest.mark.parametrize("fallback", ["layers", "toolchain"])
def test_a_kept_root_keeps_what_it_compiled_under_this_key_over_a_donors_layer(tmp_path, store, sqlite_index,
                                                                               fallback):  # fmt: skip
    """A kept ROOT (a hostPath) whose last start missed and compiled under this very key starts warm
    from its own compiles when this start misses again. With --fallback, the partial restore swapped a
    donor's layer (another model's graphs) in over those compiles, and the pod compiled everything again."""
    published(tmp_path, store, sqlite_index, GPU)  # another model on this toolchain: the donor
    mine = {**GPU, "model.id": "my-model"}
    root = tmp_path / "kept"
    assert restore(store, sqlite_index, fingerprint.compute(mine), root).status == "miss"
    own = {"inductor/fxgraph/mine": b"my graph", "triton/k2/mul.cubin": b"my triton kernel",
           f"tmp/torchinductor_{torch_user()}/precompiled_headers/mine.h.gch": b"my header"}  # fmt: skip
    write_tree(root, own)  # what the model compiled there before the pod went away unpublished
    result = restore(store, sqlite_index, fingerprint.compute(mine), root, fallback=fallback)
    assert result.status == "partial"
    for rel, data in own.items():
        assert (root / rel).read_bytes() == data, rel


def test_a_kept_root_still_takes_a_donor_over_what_a_bundle_of_its_key_laid_down(tmp_path, store, sqlite_index):
    """Files the last restore laid down from this key's bundle are not the pod's own compiles: that bundle
    may be yanked since (which is why this start missed), and the donor's layer replaces them as before."""
    published(tmp_path, store, sqlite_index, GPU)
    mine = {**GPU, "model.id": "my-model"}
    pub = published(tmp_path, store, sqlite_index, mine, tree={"inductor/fxgraph/bad": b"yanked graph"}, name="m")
    root = tmp_path / "kept"
    assert restore(store, sqlite_index, fingerprint.compute(mine), root).status == "hit"
    yank(store, sqlite_index, pub.bundle_id, "bad kernels")
    result = restore(store, sqlite_index, fingerprint.compute(mine), root, fallback="layers")
    assert result.status == "partial" and "inductor" in dict(result.donors)
    assert not (root / "inductor/fxgraph/bad").exists()
    assert (root / "inductor/fxgraph/g").read_bytes() == b"graph"
