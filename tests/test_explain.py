"""Explain: which facts separate this machine from the stored bundles, and the CLI that says so."""

import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone

from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from trees import write_tree

from kcache import fingerprint, sources
from kcache.cli import main
from kcache.explain import TOOLCHAIN, WORKLOAD, FactDiff, diff_facts, explain
from kcache.index import Bundle, Index
from kcache.publish import publish
from kcache.store.local import LocalStore

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
FACTS = {
    "os": "linux", "arch": "x86_64", "python": "3.11", "torch.version": "2.13.0+cpu", "cpu.isa": "avx512",
    "cpu.threads": "2", "cxx.name": "g++", "gpu.sm": "none", "model.id": "test-model",
}  # fmt: skip


def bundle(facts: dict, *, age_days: float = 0, status: str = "active", id: str | None = None) -> Bundle:
    fp = fingerprint.compute(facts)
    return Bundle(id or f"{fp.bundle_key}{age_days}", fp.bundle_key, fp.toolchain_key, fp.workload_key,
                  facts.get("model.id"), dict(facts), ("inductor",), 1, 10, T0 - timedelta(days=age_days),
                  "builder", status)  # fmt: skip


# ---- diff logic --------------------------------------------------------------------------------


def test_diff_names_each_side_groups_and_orders_toolchain_first():
    here = {"cpu.isa": "avx2", "model.id": "a", "extra.tp": "2", "os": "linux", "env.TORCHINDUCTOR_X": "1"}
    there = {"cpu.isa": "avx512", "model.id": "b", "os": "linux", "gpu.sm": "sm_90"}
    assert diff_facts(here, there) == (
        FactDiff("cpu.isa", "avx2", "avx512"),
        FactDiff("env.TORCHINDUCTOR_X", "1", None),  # set here only
        FactDiff("gpu.sm", None, "sm_90"),  # the bundle's publisher had a GPU
        FactDiff("extra.tp", "2", None),
        FactDiff("model.id", "a", "b"),
    )
    assert [d.group for d in diff_facts(here, there)] == [TOOLCHAIN] * 3 + [WORKLOAD] * 2


fact_names = st.sampled_from(sorted(FACTS) + ["extra.tp", "env.TORCHINDUCTOR_FOO", "model.dtype", "cxx.version"])
fact_maps = st.dictionaries(fact_names, st.sampled_from(["a", "b", "none", ""]), max_size=12)


@given(here=fact_maps, there=fact_maps)
def test_diff_is_exactly_the_disagreeing_facts(here, there):
    diffs = diff_facts(here, there)
    assert (diffs == ()) == (here == there)
    patched = {k: v for k, v in there.items()}
    for d in diffs:  # applying the differences to the bundle's facts gives this machine's facts
        assert d.here != d.bundle
        if d.here is None:
            del patched[d.name]
        else:
            patched[d.name] = d.here
        assert d.group == (WORKLOAD if fingerprint.is_workload_fact(d.name) else TOOLCHAIN)
    assert patched == here
    assert {d.name for d in diff_facts(there, here)} == {d.name for d in diffs}


def test_exact_match_is_a_hit_with_no_candidates():
    older, newer = bundle(FACTS, age_days=2), bundle(FACTS, age_days=1)
    result = explain(FACTS, [older, newer, bundle({**FACTS, "cpu.isa": "avx2"})])
    assert result.hit == newer and result.nearest == () and result.considered == 3


def test_ranking_fewest_differences_then_newest():
    one_old = bundle({**FACTS, "cpu.threads": "8"}, age_days=5)
    one_new = bundle({**FACTS, "python": "3.12"}, age_days=1)
    two = bundle({**FACTS, "python": "3.12", "cpu.isa": "avx2"}, age_days=0)
    three = bundle({**FACTS, "model.id": "other", "os": "darwin", "arch": "arm64"}, age_days=0)
    result = explain(FACTS, [three, two, one_old, one_new], limit=3)
    assert result.hit is None
    assert [c.bundle for c in result.nearest] == [one_new, one_old, two]
    assert [len(c.differences) for c in result.nearest] == [1, 1, 2]


def test_verdict_names_the_most_decisive_fact():
    result = explain(FACTS, [bundle({**FACTS, "cpu.isa": "avx2", "cpu.threads": "8", "model.id": "x"})])
    (cand,) = result.nearest
    assert cand.verdict.startswith("differs in cpu.isa (avx512 here, avx2 in bundle) and 2 more facts: ")
    assert "another ISA are never restored" in cand.verdict
    assert [d.name for d in cand.group(TOOLCHAIN)] == ["cpu.isa", "cpu.threads"]
    assert [d.name for d in cand.group(WORKLOAD)] == ["model.id"]


def test_verdict_for_facts_on_one_side_and_unknown_facts():
    missing = {k: v for k, v in FACTS.items() if k != "cxx.name"}
    (cand,) = explain(FACTS, [bundle(missing)]).nearest
    assert (
        cand.verdict == "differs in cxx.name (g++ here, absent in bundle): the C++ compiler is part of Inductor's keys"
    )
    (cand,) = explain(FACTS, [bundle({**FACTS, "zz.new": "1"})]).nearest
    assert cand.verdict.endswith("every toolchain fact must match exactly")
    assert "absent here" in cand.verdict


def test_a_yanked_bundle_with_our_key_is_not_a_hit():
    yanked = bundle(FACTS, status="yanked")
    result = explain(FACTS, [yanked])
    assert result.hit is None
    assert result.nearest[0].differences == () and "yanked" in result.nearest[0].verdict


def test_same_facts_under_another_key_blames_the_schema():
    other = replace(bundle(FACTS), bundle_key="f" * 32)
    assert "fingerprint schema" in explain(FACTS, [other]).nearest[0].verdict


# ---- the CLI against a real index ----------------------------------------------------------------


def run(*args):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_explains_a_hit_and_a_miss_on_cpu_isa(tmp_path):
    store_url, index_url = f"file://{tmp_path / 'store'}", f"sqlite:///{tmp_path / 'index.db'}"
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph", "triton/k/kernel.cubin": b"\x7fELF"})
    # Published from this machine's probed facts, as `kcache publish` would, with the ISA pinned.
    fp = fingerprint.collect(model="m", overrides={"cpu.isa": "avx512"})
    index = Index.open(index_url)
    try:
        published = publish(LocalStore(tmp_path / "store"), index, fp, sources.select(), root=tmp_path / "src", env={})
    finally:
        index.close()
    where = ("--store", store_url, "--index", index_url, "--model", "m")

    hit = json.loads(run("explain", *where, "--fact", "cpu.isa=avx512", "--json"))
    assert hit["status"] == "hit" and hit["hit"]["bundle_id"] == published.bundle_id and hit["nearest"] == []
    assert hit["bundle_key"] == fp.bundle_key and hit["facts"]["cpu.isa"] == "avx512"
    assert "hit: bundle " + published.bundle_id[:12] in run("explain", *where, "--fact", "cpu.isa=avx512")

    miss = json.loads(run("explain", *where, "--fact", "cpu.isa=avx2", "--json"))
    assert miss["status"] == "miss" and miss["hit"] is None
    (near,) = miss["nearest"]
    assert near["bundle"]["bundle_id"] == published.bundle_id
    assert near["differences"] == {"toolchain": [{"fact": "cpu.isa", "here": "avx2", "bundle": "avx512"}],
                                   "workload": []}  # fmt: skip
    assert near["verdict"].startswith("differs in cpu.isa (avx2 here, avx512 in bundle): kernels built for another ISA")

    text = run("explain", *where, "--fact", "cpu.isa=avx2")
    assert "miss: no active bundle" in text and "verdict: differs in cpu.isa (avx2 here, avx512 in bundle)" in text


def test_cli_explain_on_an_empty_index(tmp_path):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    assert CliRunner().invoke(main, ["db", "upgrade", "--index", url]).exit_code == 0  # a named index must exist
    out = run("explain", "--index", url, "--model", "m")
    assert "the index holds no bundles" in out


# ---- new facts and facts-file disagreements (issue 8) ------------------------------------------------


def test_a_cpu_feature_difference_is_named_with_its_reason():
    rich = {**FACTS, "cpu.features": "avx2 avx512f gfni vaes"}
    (cand,) = explain({**FACTS, "cpu.features": "avx2 avx512f sha"}, [bundle(rich)]).nearest
    assert cand.verdict.startswith("differs in cpu.features (1 here only: sha, 2 in bundle only: gfni vaes): ")
    assert "SIGILL" in cand.verdict
    (diff,) = cand.differences
    assert (diff.here_only, diff.bundle_only) == (("sha",), ("gfni", "vaes"))


def test_a_long_feature_list_names_the_one_feature_that_differs():
    """A real cpu.features is hundreds of characters: cut at the same length, both sides looked alike."""
    features = " ".join(f"feature{i:02d}" for i in range(40))
    (cand,) = explain({**FACTS, "cpu.features": features},
                      [bundle({**FACTS, "cpu.features": features + " gfni"})]).nearest  # fmt: skip
    assert cand.verdict.startswith("differs in cpu.features (1 in bundle only: gfni): ")
    (cand,) = explain(
        {**FACTS, "cpu.features": features + " gfni"}, [bundle({**FACTS, "cpu.features": features})]
    ).nearest
    assert cand.verdict.startswith("differs in cpu.features (1 here only: gfni): ")


def test_a_fact_that_is_not_a_set_is_quoted_whole_sides():
    (cand,) = explain({**FACTS, "cxx.version": "12.2.0"}, [bundle({**FACTS, "cxx.version": "13.1.0"})]).nearest
    assert cand.verdict.startswith("differs in cxx.version (12.2.0 here, 13.1.0 in bundle): ")
    (diff,) = cand.differences
    assert (diff.here_only, diff.bundle_only) == (None, None)


def test_a_contradicted_facts_file_is_never_a_hit():
    from kcache.fingerprint import Mismatch

    wrong = (Mismatch("cpu.features", "avx2", "avx2 avx512f"),)
    result = explain(FACTS, [bundle(FACTS)], mismatches=wrong)
    assert result.hit is None and result.fingerprint.mismatches == wrong
    (cand,) = result.nearest
    assert cand.differences == () and "facts file" in cand.verdict and "cpu.features" in cand.verdict


def test_cli_explain_shows_features_and_facts_file_disagreements(tmp_path):
    from kcache import probes

    facts = {**FACTS, "arch": probes.probe_platform({})["arch"], "cpu.features": "avx avx2 fma"}
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps({"facts": facts}))
    store_url, index_url = f"file://{tmp_path / 'store'}", f"sqlite:///{tmp_path / 'index.db'}"
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    index = Index.open(index_url)
    try:  # published where the facts were taken: the bundle key matches the file exactly
        as_claimed = fingerprint.collect(facts_file=facts_file, checks=())
        published = publish(LocalStore(tmp_path / "store"), index, as_claimed, sources.select(),
                            root=tmp_path / "src", env={})  # fmt: skip
    finally:
        index.close()
    where = ("--store", store_url, "--index", index_url, "--facts-file", str(facts_file))

    doc = json.loads(run("explain", *where, "--json"))
    assert doc["status"] == "miss" and doc["hit"] is None and doc["bundle_key"] == as_claimed.bundle_key
    here = probes.probe_cpu({})["cpu.features"]
    assert {"fact": "cpu.features", "facts_file": "avx avx2 fma", "here": here} in doc["mismatches"]
    (near,) = doc["nearest"]
    assert near["bundle"]["bundle_id"] == published.bundle_id and "cpu.features" in near["verdict"]

    text = run("explain", *where)
    assert "the facts file disagrees with this machine" in text
    assert "miss: the facts file does not describe this machine: cpu.features" in text

    probed = json.loads(run("explain", "--store", store_url, "--index", index_url, "--json"))
    assert probed["facts"]["cpu.features"] == here and probed["mismatches"] == []


def test_cli_explain_json_names_the_features_only_one_side_has(tmp_path):
    store_url, index_url = f"file://{tmp_path / 'store'}", f"sqlite:///{tmp_path / 'index.db'}"
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    here = fingerprint.collect(model="m")
    richer = fingerprint.compute({**here.facts, "cpu.features": here.facts["cpu.features"] + " zz_gfni"})
    index = Index.open(index_url)
    try:
        publish(LocalStore(tmp_path / "store"), index, richer, sources.select(), root=tmp_path / "src", env={})
    finally:
        index.close()
    doc = json.loads(run("explain", "--store", store_url, "--index", index_url, "--model", "m", "--json"))
    (near,) = doc["nearest"]
    (diff,) = near["differences"]["toolchain"]
    assert diff["fact"] == "cpu.features" and (diff["here_only"], diff["bundle_only"]) == ([], ["zz_gfni"])
    assert "1 in bundle only: zz_gfni" in near["verdict"]


def test_cli_explain_reuses_no_layer_when_the_facts_file_is_contradicted(tmp_path):
    """Restore takes no layer from any bundle then (kcache/restore.py): explain must not promise one."""
    from kcache import probes
    from kcache.restore import restore

    facts = {**FACTS, "arch": probes.probe_platform({})["arch"], "cpu.features": "avx avx2 fma"}
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps({"facts": facts}))
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    store, index = LocalStore(tmp_path / "store"), Index.open(f"sqlite:///{tmp_path / 'index.db'}")
    try:  # another model's bundle, published where the facts were taken: its inductor layer key matches
        other = fingerprint.collect(facts_file=facts_file, checks=(), model="other")
        publish(store, index, other, sources.select(), root=tmp_path / "src", env={})
        contradicted = fingerprint.collect(facts_file=facts_file)
        assert contradicted.mismatches
        assert restore(store, index, contradicted, tmp_path / "dst", fallback="layers").status == "miss"
    finally:
        index.close()
    where = ("--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'index.db'}",
             "--facts-file", str(facts_file))  # fmt: skip

    layers = json.loads(run("explain", *where, "--json"))["layers"]
    assert {v["layer"] for v in layers} >= {"inductor", "triton", "cuda"}
    for v in layers:
        assert v["donor"] is None and "facts file does not describe this machine" in v["verdict"], v
    text = run("explain", *where)
    assert "reusable from bundle" not in text
    assert "reuses no layer: the facts file does not describe this machine" in text


def test_what_march_native_turns_on_is_named_feature_by_feature():
    here = {**FACTS, "cxx.native": "avx2 avx512f fma"}
    (cand,) = explain(here, [bundle({**FACTS, "cxx.native": "apxf avx10.2 avx2 avx512f fma"})]).nearest
    assert cand.verdict.startswith("differs in cxx.native (2 in bundle only: apxf avx10.2): ")
    assert "-march=native" in cand.verdict and "SIGILL" in cand.verdict


def test_an_engine_version_is_named_with_its_reason():
    (cand,) = explain({**FACTS, "engine.vllm": "0.11.0"}, [bundle({**FACTS, "engine.vllm": "0.10.2"})]).nearest
    assert cand.verdict.startswith("differs in engine.vllm (0.11.0 here, 0.10.2 in bundle): ")
    assert "every toolchain fact must match" not in cand.verdict and "version" in cand.verdict


def test_cli_explain_a_bundle_the_store_marks_yanked_is_a_miss_as_in_restore(tmp_path):
    """A yank marker stops a bundle whatever the index says (any store writer may add one): explain
    had said "hit ... `kcache restore` lays it down" where restore missed."""
    from kcache import refs

    store = LocalStore(tmp_path / "store")
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    fp = fingerprint.collect(model="m", overrides={"cpu.isa": "avx512"})
    index = Index.open(f"sqlite:///{tmp_path / 'index.db'}")
    try:
        published = publish(store, index, fp, sources.select(), root=tmp_path / "src", env={})
    finally:
        index.close()
    assert store.put_bytes(refs.yank_key(published.bundle_id), b"yanked by hand")
    where = ("--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'index.db'}", "--model",
             "m", "--fact", "cpu.isa=avx512")  # fmt: skip
    doc = json.loads(run("explain", *where, "--json"))
    assert doc["status"] == "miss" and doc["hit"] is None and doc["yanked_in_store"] == published.bundle_id
    text = run("explain", *where)
    assert "hit:" not in text and "miss:" in text and refs.yank_key(published.bundle_id) in text


def test_a_gcc_search_path_set_on_one_side_is_named():
    (cand,) = explain({**FACTS, "env.CPATH": "/opt/inc"}, [bundle(FACTS)]).nearest
    assert cand.verdict.startswith("differs in env.CPATH (/opt/inc here, absent in bundle): ")
    assert "g++ reads it" in cand.verdict
    (cand,) = explain(FACTS, [bundle({**FACTS, "env.LIBRARY_PATH": ""})]).nearest
    assert cand.verdict.startswith("differs in env.LIBRARY_PATH (absent here,  in bundle): ")


def test_an_nvcc_setting_is_named_as_nvcc_s():
    (cand,) = explain({**FACTS, "env.NVCC_APPEND_FLAGS": "--use_fast_math"}, [bundle(FACTS)]).nearest
    assert cand.verdict.startswith("differs in env.NVCC_APPEND_FLAGS (--use_fast_math here, absent in bundle): ")
    assert "nvcc reads it" in cand.verdict


def test_a_debug_python_is_named_with_its_abi():
    (cand,) = explain({**FACTS, "python": "3.11d"}, [bundle(FACTS)]).nearest
    assert cand.verdict.startswith("differs in python (3.11d here, 3.11 in bundle): ")
    assert "ABI" in cand.verdict


def test_explain_says_why_the_cuda_compiler_is_keyed():
    from kcache.explain import reason

    assert "nvcc" in reason("cuda.nvcc") and reason("cuda.nvcc") != reason("cuda.other")
