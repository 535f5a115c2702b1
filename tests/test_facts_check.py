"""A facts file that this machine contradicts is a miss naming the facts, never a hit (issue 8, item 3)."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache import fingerprint, probes, sources
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import ConfigError
from kcache.index import Index
from kcache.publish import publish
from kcache.restore import read_state, restore
from kcache.store.local import LocalStore

# What `kcache fingerprint --json` printed in a model container on an AVX2 node with this arch.
AVX2_FACTS = {
    "os": "linux", "arch": probes.probe_platform({})["arch"], "python": "3.12", "torch.version": "2.13.0+cu128",
    "cpu.isa": "avx2", "cpu.features": "avx avx2 f16c fma sse sse2 sse4_1 sse4_2 ssse3", "gpu.sm": "none",
    "model.id": "m",
}  # fmt: skip


def setup(tmp_path):
    """A facts file, and a bundle published under exactly its keys: without the check, a hit."""
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps({"facts": AVX2_FACTS}))
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph built for avx2"})
    return facts_file, fingerprint.collect(facts_file=facts_file, checks=())


def test_restore_with_a_stale_facts_file_is_a_miss_naming_the_facts(tmp_path, store, sqlite_index):
    facts_file, as_claimed = setup(tmp_path)
    publish(store, sqlite_index, as_claimed, sources.select(), root=tmp_path / "src", env={})
    fp = fingerprint.collect(facts_file=facts_file)  # checked against this machine
    assert fp.bundle_key == as_claimed.bundle_key and "cpu.features" in [m.fact for m in fp.mismatches]

    result = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert result.status == "miss" and result.bundle_id is None
    assert "cpu.features" in result.reason and "facts file" in result.reason
    assert not (tmp_path / "dst/inductor/fxgraph/g").exists()
    assert (tmp_path / "dst/kcache.env").exists() and read_state(tmp_path / "dst")["status"] == "miss"
    assert restore(store, sqlite_index, as_claimed, tmp_path / "dst2").status == "hit"  # the bundle is there


def test_cli_restore_strict_has_its_own_exit_code(tmp_path):
    facts_file, as_claimed = setup(tmp_path)
    index = Index.open(f"sqlite:///{tmp_path / 'i.db'}")
    try:
        publish(LocalStore(tmp_path / "store"), index, as_claimed, sources.select(), root=tmp_path / "src", env={})
    finally:
        index.close()
    where = ["--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'i.db'}"]
    runner = CliRunner()
    args = ["restore", "--into", str(tmp_path / "dst"), "--facts-file", str(facts_file), *where]
    lenient = runner.invoke(main, args, catch_exceptions=False)
    assert lenient.exit_code == 0 and "miss" in lenient.output and "cpu.features" in lenient.output
    strict = runner.invoke(main, [*args, "--strict"], catch_exceptions=False)
    assert strict.exit_code == ExitCode.FACTS_DISAGREE
    plain_miss = runner.invoke(main, ["restore", "--into", str(tmp_path / "x"), "--model", "none-such", "--strict",
                                      *where], catch_exceptions=False)  # fmt: skip
    assert plain_miss.exit_code == ExitCode.MISS  # an ordinary miss has its own code


def test_fingerprint_shows_the_disagreements(tmp_path):
    facts_file, _ = setup(tmp_path)
    env = {"KCACHE_FACTS_FILE": str(facts_file)}
    doc = json.loads(CliRunner().invoke(main, ["fingerprint", "--json"], env=env).output)
    here = probes.probe_cpu(os.environ)["cpu.features"]
    assert {"fact": "cpu.features", "facts_file": AVX2_FACTS["cpu.features"], "here": here} in doc["mismatches"]
    text = CliRunner().invoke(main, ["fingerprint"], env=env).output
    assert "the facts file disagrees with this machine" in text and "cpu.features" in text
    assert "restore will miss" in text


def test_publish_refuses_to_file_this_machines_kernels_under_a_facts_file_it_contradicts(tmp_path, store, sqlite_index):
    facts_file, _ = setup(tmp_path)
    fp = fingerprint.collect(facts_file=facts_file)
    with pytest.raises(ConfigError, match="cpu.features"):
        publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert sqlite_index.newest_bundle(fp.bundle_key) is None


def test_the_example_facts_file_has_the_core_facts(tmp_path):
    import yaml

    docs = yaml.safe_load_all((Path(__file__).parent.parent / "examples/k8s/deployment.yaml").read_text())
    (config_map,) = [d for d in docs if d["metadata"]["name"] == "llm-kcache-facts"]
    path = tmp_path / "facts.json"
    path.write_text(config_map["data"]["facts.json"])
    facts = fingerprint.load_facts_file(path)
    assert set(fingerprint.CORE_FACTS) <= set(facts) and "cpu.model" not in facts and "cpu.flags" not in facts


# ---- publish and watch from a restored ROOT, without --model ---------------------------------------


def restored_root(tmp_path):
    """A facts file without a model (as examples/k8s keeps it), and a ROOT a restore with --model m left."""
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps({"facts": {k: v for k, v in AVX2_FACTS.items() if k != "model.id"}}))
    root = tmp_path / "root"
    write_tree(root, {"inductor/fxgraph/g": b"kernels built on this machine, not on the AVX2 node"})
    (root / ".kcache-state.json").write_text(json.dumps({"status": "miss", "inputs": {"model.id": "m"}}))
    where = ["--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'i.db'}"]
    return facts_file, root, where


def _bundles(where):
    return json.loads(CliRunner().invoke(main, ["ls", "--json", *where], catch_exceptions=False).output)


@pytest.mark.parametrize("model", [["--model", "m"], []], ids=["model-flag", "model-from-root"])
def test_publish_from_a_root_refuses_a_contradicted_facts_file_with_or_without_model(tmp_path, model):
    facts_file, root, where = restored_root(tmp_path)
    args = ["publish", "--from", str(root), "--facts-file", str(facts_file), *model, *where]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == ExitCode.USAGE and "cpu.features" in result.stderr, result.output
    assert _bundles(where) == []


def test_watch_without_model_refuses_to_publish_under_a_contradicted_facts_file(tmp_path):
    from kcache.readiness import WARMUP_MARKER, write_marker

    facts_file, root, where = restored_root(tmp_path)
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    watch = ["watch", "--root", str(root), "--once", "--facts-file", str(facts_file)]
    assert CliRunner().invoke(main, watch, catch_exceptions=False).exit_code == 0  # the baseline
    write_tree(root, {"inductor/fxgraph/late": b"compiled after ready"})
    result = CliRunner().invoke(main, [*watch, "--json", "--publish-every", "10m", *where], catch_exceptions=False)
    assert result.exit_code == ExitCode.PUBLISH
    doc = json.loads(result.stdout)
    assert doc["published"] is None and "cpu.features" in doc["publish_error"]
    assert _bundles(where) == []


# ---- --fact overrides of node facts: checked as a facts file is --------------------------------------


def test_publish_refuses_a_fact_that_describes_another_cpu(tmp_path):
    """`publish --fact cpu.features=<another CPU's>` filed this machine's -march=native kernels under the
    other CPU's key, and every pod of that CPU restored them: the override is checked as a facts file is."""
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"kernels built with this machine's -march=native"})
    where = ["--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'i.db'}"]
    args = ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--fact",
            f"cpu.features={AVX2_FACTS['cpu.features']}", *where]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == ExitCode.USAGE and "cpu.features" in result.stderr, result.output
    assert "--fact" in result.stderr
    assert _bundles(where) == []


def test_restore_with_a_fact_that_describes_another_cpu_is_a_miss(tmp_path, store, sqlite_index):
    """A bundle honestly published on the AVX2 machine: a pod here claiming its features must not run it."""
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph built for avx2"})
    claimed = {"cpu.features": AVX2_FACTS["cpu.features"]}
    there = fingerprint.compute({**fingerprint.collect(model="m").facts, **claimed})
    publish(store, sqlite_index, there, sources.select(), root=tmp_path / "src", env={})
    fp = fingerprint.collect(model="m", overrides=claimed)
    assert fp.bundle_key == there.bundle_key and [m.fact for m in fp.mismatches] == ["cpu.features"]
    result = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert result.status == "miss" and "cpu.features" in result.reason and "--fact" in result.reason
    assert not (tmp_path / "dst/inductor/fxgraph/g").exists()


def test_a_fact_this_machine_cannot_see_is_not_checked():
    """A CPU-only builder may still give the production GPU's facts (prebake), and any fact no check
    reads (cpu.isa, model facts) stays a plain override."""
    fp = fingerprint.collect(model="m", overrides={"gpu.sm": "sm_90", "gpu.name": "NVIDIA H100 80GB HBM3",
                                                   "cpu.isa": "avx2"}, env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert fp.facts["gpu.sm"] == "sm_90" and fp.mismatches == ()
    here = fingerprint.collect(model="m", env={})
    same = fingerprint.collect(model="m", overrides={"cpu.features": here.facts["cpu.features"]}, env={})
    assert same.mismatches == () and same.bundle_key == here.bundle_key


def test_a_fact_naming_another_gpu_than_the_visible_one_is_checked():
    """An A10 node's pod claiming the H100's facts would publish sm_86 kernels under sm_90's key."""
    from functools import partial

    from kcache import gpus

    a10 = gpus.Reading((gpus.Device("GPU-bbbb0-0000", "NVIDIA A10", "sm_86"),), "570.124.06")
    checks = (partial(probes.check_gpu, read=lambda: a10, present=lambda: True),)
    fp = fingerprint.collect(model="m", overrides={"gpu.sm": "sm_90", "gpu.count": "1"}, env={}, checks=checks)
    assert [(m.fact, m.claimed, m.probed) for m in fp.mismatches] == [("gpu.sm", "sm_90", "sm_86")]
    assert fp.mismatch_reason() == "--fact does not describe this machine: gpu.sm (sm_90 by --fact, sm_86 here)"
