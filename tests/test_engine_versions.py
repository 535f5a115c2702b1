"""Which engine version a machine has, however the engine was installed: a different version is always a
different bundle key (a shared value would restore one version's kernels and tactics under another).

Layouts built here, as pip and source checkouts leave them:
    wheel     site/<module>/... beside site/<dist>-<v>.dist-info (METADATA, RECORD hashing the code)
    editable  checkout/<module>/... with only site/<dist>-<v>.dist-info (METADATA) elsewhere on sys.path
    checkout  checkout/<module>/... and no metadata at all
Every package's __init__.py exits when imported: the probe must read them, never import them.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kcache import engines, fingerprint

BLOCKS_IMPORT = "raise SystemExit('imported!')\n"


def code(where: Path, version: str, module: str = "vllm") -> Path:
    """A package whose version.py names `version` (as vLLM's, SGLang's and TensorRT-LLM's do)."""
    pkg = where / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(BLOCKS_IMPORT)
    (pkg / "version.py").write_text(f"__version__ = {version!r}\n")
    return pkg


def metadata(site: Path, dist: str, version: str, record: Path | None = None) -> Path:
    """A dist-info for `dist`; with `record`, a RECORD listing (and hashing) every file of that package."""
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if record is not None:
        lines = []
        for path in sorted(p for p in record.rglob("*") if p.is_file()):
            data = path.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{path.relative_to(site).as_posix()},sha256={digest},{len(data)}")
        lines.append(f"{info.name}/METADATA,,")
        (info / "RECORD").write_text("\n".join(lines) + "\n")
    return info


def wheel(site: Path, version: str, module: str = "vllm", dist: str = "vllm") -> Path:
    pkg = code(site, version, module)
    metadata(site, dist, version, record=pkg)
    return pkg


@pytest.fixture
def path(monkeypatch):
    """Put directories first on sys.path, in order, as PYTHONPATH would (each call replaces the last)."""
    original = list(sys.path)

    def put(*dirs: Path) -> None:
        monkeypatch.setattr(sys, "path", [str(d) for d in dirs] + original)
        importlib.invalidate_caches()

    return put


def probed(name: str = "vllm") -> str | None:
    return engines.probe_engines({}).get(f"engine.{name}")


# ---- the reviewer's reproductions ----------------------------------------------------------------


def test_editable_installs_of_two_versions_get_two_bundle_keys(tmp_path, path):
    keys, facts = set(), set()
    for v in ("0.9.0", "0.10.0"):
        (tmp_path / f"src{v}" / "vllm").mkdir(parents=True)
        (tmp_path / f"src{v}" / "vllm" / "__init__.py").write_text("")  # the same (empty) code in both
        metadata(tmp_path / f"site{v}", "vllm", v)
        path(tmp_path / f"src{v}", tmp_path / f"site{v}")
        fp = fingerprint.collect(overrides={"model.id": "m1"}, env={})
        assert v in fp.facts["engine.vllm"]
        keys.add(fp.bundle_key)
        facts.add(fp.facts["engine.vllm"])
    assert len(keys) == 2 and len(facts) == 2
    assert "vllm" not in sys.modules


def test_the_cli_keys_editable_installs_by_their_version(tmp_path):
    keys = {}
    for v in ("0.9.0", "0.10.0"):
        code(tmp_path / f"src{v}", "dev")  # a checkout without setuptools-scm's _version.py says "dev"
        metadata(tmp_path / f"site{v}", "vllm", v)
        env = {**os.environ, "PYTHONPATH": f"{tmp_path / f'src{v}'}{os.pathsep}{tmp_path / f'site{v}'}"}
        out = subprocess.run([sys.executable, "-m", "kcache", "fingerprint", "--model", "m1", "--json"],
                             capture_output=True, text=True, check=True, env=env).stdout  # fmt: skip
        printed = json.loads(out)
        assert v in printed["facts"]["engine.vllm"]
        keys[v] = printed["bundle_key"]
    assert keys["0.9.0"] != keys["0.10.0"]


@pytest.mark.parametrize("installed", ["0.9.2", "0.10.1"])
def test_of_two_dist_infos_side_by_side_the_one_whose_record_matches_the_code_wins(tmp_path, path, installed):
    stale = "0.10.1" if installed == "0.9.2" else "0.9.2"
    pkg = code(tmp_path, stale)
    metadata(tmp_path, "vllm", stale, record=pkg)  # what an earlier install left
    (pkg / "version.py").write_text(f"__version__ = {installed!r}\n")
    metadata(tmp_path, "vllm", installed, record=pkg)
    path(tmp_path)
    assert probed() == installed


def test_two_dist_infos_without_records_name_the_newest_and_still_tell_the_code_apart(tmp_path, path):
    facts = []
    for code_version in ("0.9.2", "0.10.1"):
        site = tmp_path / code_version
        code(site, code_version)
        metadata(site, "vllm", "0.9.2")
        metadata(site, "vllm", "0.10.1")
        path(site)
        facts.append(probed())
    assert facts[0] != facts[1]
    assert all(f.startswith("0.10.1") for f in facts)  # 0.10.1 > 0.9.2, as versions and not as strings


# ---- checkouts, stale and missing metadata ---------------------------------------------------------


def test_a_checkout_without_metadata_is_keyed_by_its_code_not_a_shared_unknown(tmp_path, path):
    facts = {}
    for name, version in (("a", "0.9.0"), ("b", "0.10.0"), ("c", "0.10.0")):
        code(tmp_path / name, version)
        path(tmp_path / name)
        facts[name] = probed()
    assert facts["a"] != facts["b"]
    assert facts["b"] == facts["c"]  # the same code anywhere on disk: replicas share a key
    assert facts["a"] != "unknown" and facts["b"] != "unknown"


def test_a_checkout_shadowing_an_installed_wheel_is_not_taken_for_the_wheel(tmp_path, path):
    wheel(tmp_path / "site", "0.9.0")
    path(tmp_path / "site")
    plain = probed()
    assert plain == "0.9.0"
    code(tmp_path / "src", "0.10.0")
    path(tmp_path / "src", tmp_path / "site")
    assert probed() != plain


def test_an_editable_install_whose_checkout_moved_on_differs_from_the_release(tmp_path, path):
    wheel(tmp_path / "site", "0.9.0")
    path(tmp_path / "site")
    release = probed()
    code(tmp_path / "src", "0.10.0")  # `pip install -e` at 0.9.0, then `git checkout v0.10.0`
    metadata(tmp_path / "site-e", "vllm", "0.9.0")
    path(tmp_path / "src", tmp_path / "site-e")
    assert probed() != release


def test_code_edited_after_install_is_not_vouched_for_by_its_record(tmp_path, path):
    pkg = wheel(tmp_path, "0.9.0")
    path(tmp_path)
    assert probed() == "0.9.0"
    (pkg / "version.py").write_text("__version__ = '0.10.0'\n")
    assert probed() != "0.9.0"


def test_an_installed_wheel_keeps_its_plain_version(tmp_path, path):
    """What existing installs were keyed by: unchanged, so their bundles still hit."""
    wheel(tmp_path, "0.8.5")
    code(tmp_path / "other", "0.8.5", module="sglang")  # another engine's checkout does not disturb it
    path(tmp_path, tmp_path / "other")
    assert probed() == "0.8.5"
    assert "vllm" not in sys.modules


# ---- every engine the module knows --------------------------------------------------------------


@pytest.mark.parametrize("engine", list(engines.ENGINES))
def test_every_engine_keys_each_layout_by_its_version(tmp_path, path, engine):
    module, dists = engines.ENGINES[engine]
    for dist in dists:
        site = tmp_path / dist / "wheel"
        wheel(site, "1.2.0", module, dist)
        path(site)
        assert probed(engine) == "1.2.0"
    seen = set()
    for v in ("1.2.0", "1.10.0"):
        code(tmp_path / f"src{v}", "dev", module)
        metadata(tmp_path / f"site{v}", dists[0], v)
        path(tmp_path / f"src{v}", tmp_path / f"site{v}")
        seen.add(probed(engine))
    assert len(seen) == 2
    assert module not in sys.modules


@pytest.mark.parametrize("payload", ["python_packages", "dsl_packages"])
def test_the_cute_dsl_is_read_where_its_wheels_put_it(tmp_path, path, payload):
    """nvidia-cutlass-dsl installs `cutlass` under nvidia_cutlass_dsl/<payload>/ (a .pth puts it on
    sys.path): up to 4.3 in its own wheel, from 4.4 in nvidia-cutlass-dsl-libs-* wheels beside a
    metadata-only nvidia-cutlass-dsl."""
    site = tmp_path / "site"
    inner = site / "nvidia_cutlass_dsl" / payload
    pkg = code(inner, "4.3.0", "cutlass")
    if payload == "python_packages":
        metadata(site, "nvidia_cutlass_dsl", "4.3.0", record=pkg)
    else:
        metadata(site, "nvidia_cutlass_dsl", "4.3.0")  # the shim
        metadata(site, "nvidia_cutlass_dsl_libs_base", "4.3.0", record=pkg)
    path(site, inner)
    assert probed("cutlass_dsl") == "4.3.0"


def test_cute_dsl_libraries_of_another_version_change_the_fact(tmp_path, path):
    """4.6 split the pure-Python core (libs-core) from the generated _mlir bits (libs-base): mixing
    their versions is possible (pip installs them separately) and is not the same engine."""
    facts = []
    for base_version in ("4.6.0", "4.5.2"):
        site = tmp_path / base_version
        inner = site / "nvidia_cutlass_dsl" / "dsl_packages"
        pkg = code(inner, "4.6.0", "cutlass")
        metadata(site, "nvidia_cutlass_dsl_libs_core", "4.6.0", record=pkg)
        (pkg / "_mlir").mkdir()
        (pkg / "_mlir" / "ir.py").write_text(f"# generated for {base_version}\n")
        metadata(site, "nvidia_cutlass_dsl_libs_base", base_version, record=pkg / "_mlir")
        metadata(site, "nvidia_cutlass_dsl", "4.6.0")
        path(site, inner)
        facts.append(probed("cutlass_dsl"))
    assert facts[0] == "4.6.0" and facts[1] != facts[0] and "4.5.2" in facts[1]


# ---- comparing versions -------------------------------------------------------------------------


@pytest.mark.parametrize("without_packaging", [False, True])
def test_versions_compare_as_versions(monkeypatch, without_packaging):
    if without_packaging:  # `import packaging.version` then raises ImportError, as where it is not installed
        monkeypatch.setitem(sys.modules, "packaging.version", None)
    assert engines.newest(["0.9.2", "0.10.1", "0.10.0"]) == "0.10.1"
    assert engines.newest(["1.1.0", "1.10.0", "1.9.0"]) == "1.10.0"
