"""kcache.torch and `kcache prebake` with a real torch.compile on CPU.

A builder prebakes a tiny transformer into A (cold: every profile shape compiles), then a second
prebake into B restores A's bundle and warms up in a child process: every profile must hit
torch's FX-graph and AOTAutograd caches with no miss. The Mega-Cache blob saved into A must
hot-load into an empty cache dir.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kcache import torch as ktorch
from kcache.errors import ConfigError

TESTS = Path(__file__).resolve().parent
DIM = 64

# Two shapes keep the cold compile short; every distinct (batch, tokens) compiles a graph.
PROFILES = """\
[[profiles]]
name = "one"
batch_size = 1
input_tokens = 16
output_tokens = 1
repeats = 2

[[profiles]]
name = "two"
batch_size = 2
input_tokens = 8
output_tokens = 1
"""

_MODEL = None


def tiny(batch_size, input_tokens, output_tokens):
    """Warmup entrypoint: one forward pass of a 1-block, 64-wide kcache.torch.workload model at the
    profile's (batch, tokens) shape; a prefill only, so output_tokens is not used."""
    global _MODEL
    import torch

    from kcache.torch import workload

    if _MODEL is None:
        _MODEL = torch.compile(workload.build_model(blocks=1, dim=DIM), dynamic=False)
    with torch.no_grad():
        _MODEL(workload.make_input(batch_size, input_tokens, DIM))


# ---- without torch -------------------------------------------------------------------------------


def test_megacache_path_comes_from_the_env(tmp_path):
    assert ktorch.megacache_path(env={}) is None
    assert ktorch.megacache_path(env={"KCACHE_MEGACACHE": str(tmp_path)}) == tmp_path / "artifacts.bin"
    assert ktorch.megacache_path(tmp_path / "x.bin", env={"KCACHE_MEGACACHE": "/elsewhere"}) == tmp_path / "x.bin"


def test_save_without_a_place_is_a_config_error(monkeypatch):
    monkeypatch.delenv("KCACHE_MEGACACHE", raising=False)
    with pytest.raises(ConfigError, match="KCACHE_MEGACACHE"):
        ktorch.save_megacache()
    assert ktorch.load_megacache() is None  # nothing to load: a service starts as usual


# ---- with torch ----------------------------------------------------------------------------------


def kcache(*args, env, check=True):
    done = subprocess.run([sys.executable, "-m", "kcache", *args, "--json"], env=env, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("prebake")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "KCACHE_"))}
    env.update(KCACHE_HOME=str(base / "home"), TMPDIR=str(base / "outer-tmp"), PYTHONPATH=str(TESTS))
    (base / "outer-tmp").mkdir()
    (base / "profiles.toml").write_text(PROFILES)
    common = ["--entrypoint", "test_torch_helpers:tiny", "--profiles", str(base / "profiles.toml"), "--model", "tiny"]
    cold = kcache("prebake", "--root", str(base / "A"), *common, env=env)
    warm = kcache("prebake", "--root", str(base / "B"), *common, env=env)
    return base, env, cold, warm


@pytest.mark.torch
def test_cold_prebake_compiles_every_shape_and_publishes(baked):
    base, _env, cold, _warm = baked
    assert cold["restore"]["status"] == "miss"
    for profile in cold["warmup"]["profiles"]:
        assert profile["ok"] and profile["counters"]["fxgraph_miss"] >= 1, profile
    assert cold["warmup"]["megacache"] == str(base / "A/megacache/artifacts.bin")
    assert {"inductor", "inductor-pch", "megacache"} <= set(cold["publish"]["layers"])


@pytest.mark.torch
def test_restored_prebake_hits_for_every_profile_shape(baked):
    base, _env, cold, warm = baked
    assert warm["restore"]["status"] == "hit" and warm["restore"]["bundle_id"] == cold["publish"]["bundle_id"]
    for profile in warm["warmup"]["profiles"]:
        counters = profile["counters"]
        assert counters["fxgraph_hit"] >= 1 and counters["fxgraph_miss"] == 0, profile
        assert counters["aotautograd_hit"] >= 1 and counters["aotautograd_miss"] == 0, profile
    assert warm["warmup"]["counters"]["fxgraph_miss"] == 0
    # Nothing compiled, nothing changed: the warm re-prebake publishes the very same bundle.
    assert (base / "B/megacache/artifacts.bin").read_bytes() == (base / "A/megacache/artifacts.bin").read_bytes()
    assert warm["publish"]["bundle_id"] == cold["publish"]["bundle_id"] and not warm["publish"]["created"]
    first = {p["name"]: p["first_s"] for p in cold["warmup"]["profiles"]}
    assert all(p["first_s"] < first[p["name"]] for p in warm["warmup"]["profiles"])


MEGACACHE_CHILD = """
import json, sys
from kcache import envfile
from kcache import torch as ktorch
bad = ktorch.load_megacache(sys.argv[1])
info = ktorch.load_megacache(sys.argv[2])
import test_torch_helpers
test_torch_helpers.tiny(1, 16, 1)
print(json.dumps({"bad": bad is None, "artifacts": dict(info.artifacts), **ktorch.counters()}))
"""


@pytest.mark.torch
def test_megacache_blob_brings_back_the_graph_entries(baked):
    """A's kernels and header, without its graph and autograd entries: only the blob can make the
    compile hit. (Into a fully empty cache dir the blob still hits, but every C++ kernel and the
    ISA probes are rebuilt, ~30 s here: TORCH_FACTS.md.)"""
    base, env, cold, _warm = baked
    cache = base / "no-graphs"
    shutil.copytree(base / "A/inductor", cache)
    shutil.rmtree(cache / "fxgraph")
    shutil.rmtree(cache / "aotautograd")
    (base / "garbage.bin").write_bytes(b"not a mega-cache")
    child_env = {
        **env,
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TMPDIR": str(base / "A/tmp"),
    }
    args = [sys.executable, "-c", MEGACACHE_CHILD, str(base / "garbage.bin"), cold["warmup"]["megacache"]]
    done = subprocess.run(args, env=child_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bad"], "a corrupt blob must be ignored, not crash the service"
    assert result["artifacts"].get("inductor", 0) >= 2
    assert result["fxgraph_hit"] >= 1 and result["fxgraph_miss"] == 0
