"""Engine versions are facts (read from dist-info, never imported), present only when installed.
Editable installs, checkouts and stale metadata: tests/test_engine_versions.py."""

import base64
import hashlib
import importlib
import sys

from kcache import engines, fingerprint


def fake_site(tmp_path, monkeypatch, packages: dict[str, tuple[str, str | None]]):
    for module, (dist, version) in packages.items():
        (tmp_path / module).mkdir()
        init = tmp_path / module / "__init__.py"
        init.write_text("raise SystemExit('imported!')\n")
        if version:  # as pip installs a wheel: METADATA, and a RECORD hashing the code
            info = tmp_path / f"{dist}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            digest = base64.urlsafe_b64encode(hashlib.sha256(init.read_bytes()).digest()).rstrip(b"=").decode()
            (info / "RECORD").write_text(f"{module}/__init__.py,sha256={digest},{init.stat().st_size}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_installed_engines_become_facts(tmp_path, monkeypatch):
    fake_site(tmp_path, monkeypatch, {"vllm": ("vllm", "0.8.5"), "flashinfer": ("flashinfer_python", "0.6.1"),
                                      "deep_gemm": ("deep_gemm", None)})  # fmt: skip
    facts = engines.probe_engines({})
    assert facts["engine.vllm"] == "0.8.5" and facts["engine.flashinfer"] == "0.6.1"
    # importable without metadata: still keyed, by its code (a shared "unknown" would be a wrong hit)
    assert facts["engine.deep_gemm"].startswith("unknown source:")
    assert "vllm" not in sys.modules  # read, never imported


def test_a_probed_fingerprint_carries_the_engines(tmp_path, monkeypatch):
    fake_site(tmp_path, monkeypatch, {"vllm": ("vllm", "0.8.5")})
    assert fingerprint.collect(env={}).facts["engine.vllm"] == "0.8.5"


def test_absent_engines_leave_the_facts_alone(monkeypatch):
    monkeypatch.setattr(engines, "ENGINES", {"nope": ("kcache_no_such_module", ("nope",))})
    assert engines.probe_engines({}) == {}


def test_an_engine_upgrade_changes_the_bundle_key():
    base = {"os": "linux", "model.id": "m"}
    old = fingerprint.compute({**base, "engine.tensorrt_llm": "1.1.0"})
    new = fingerprint.compute({**base, "engine.tensorrt_llm": "1.2.0"})
    assert old.bundle_key != new.bundle_key and old.workload_key == new.workload_key
