"""When `kcache.torch.isa` trusts a probe library: only under the Inductor dir of a restore hit, and
only files that the restore wrote (not newer than its marker). No torch needed for these."""

import json
import os
from pathlib import Path

import pytest

from kcache.readiness import RESTORE_MARKER
from kcache.torch.isa import is_restored, restored_inductor_dir, trust_restored_probes


def layout(root: Path, status: str = "hit", layers=("inductor", "inductor-pch")) -> Path:
    cache = root / "inductor"
    (cache / "ab").mkdir(parents=True)
    probe = cache / "ab" / "probe.so"
    probe.write_bytes(b"\x7fELF")
    (root / RESTORE_MARKER).write_text(json.dumps({"status": status, "layers": list(layers)}))
    os.utime(probe, ns=(1, 1))  # as restore leaves it: the publisher's mtime, long before the marker
    return probe


@pytest.mark.parametrize("status", ["hit", "partial"])
def test_a_hit_or_a_partial_restore_of_the_layer_vouches_for_its_inductor_dir(tmp_path, status):
    """A partial restore (--fallback toolchain or layers) lays the inductor layer down from a bundle of
    this toolchain key (layerkeys.FACTS: inductor is keyed on the whole toolchain), as a hit does; it
    ran six probe interpreters and a header preprocessing again (2.68 s -> 3.48 s to first output)."""
    layout(tmp_path, status)
    assert restored_inductor_dir({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}) == tmp_path / "inductor"


@pytest.mark.parametrize("status,layers", [("miss", ()), ("error", ()), ("partial", ("triton",)),
                                           ("hit", ("triton",))])  # fmt: skip
def test_nothing_else_vouches(tmp_path, status, layers):
    layout(tmp_path, status, layers)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert restored_inductor_dir(env) is None
    assert trust_restored_probes(env) is False  # and torch is never imported for it


def test_no_cache_dir_or_no_marker_vouches_for_nothing(tmp_path):
    assert restored_inductor_dir({}) is None
    (tmp_path / "inductor").mkdir()
    assert restored_inductor_dir({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}) is None
    (tmp_path / RESTORE_MARKER).write_text("not json")
    assert restored_inductor_dir({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}) is None


def test_only_files_the_restore_wrote_are_trusted(tmp_path):
    probe = layout(tmp_path)
    cache = tmp_path / "inductor"
    assert is_restored(str(probe), cache)
    later = cache / "ab" / "built-here.so"
    later.write_bytes(b"\x7fELF")
    os.utime(later, ns=(2**62, 2**62))  # compiled after the restore finished
    assert not is_restored(str(later), cache)
    outside = tmp_path / "elsewhere.so"
    outside.write_bytes(b"\x7fELF")
    os.utime(outside, ns=(1, 1))
    assert not is_restored(str(outside), cache)
    assert not is_restored(str(cache / "ab" / ".." / ".." / "elsewhere.so"), cache)
    link = cache / "ab" / "link.so"
    link.symlink_to(outside)
    assert not is_restored(str(link), cache)
    assert not is_restored(str(cache / "ab" / "missing.so"), cache)


def test_a_cache_dir_behind_a_link_is_still_trusted(tmp_path):
    probe = layout(tmp_path / "real")
    (tmp_path / "mounted").symlink_to(tmp_path / "real")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mounted" / "inductor")}
    cache = restored_inductor_dir(env)
    assert cache is not None
    through_link = tmp_path / "mounted" / "inductor" / probe.relative_to(tmp_path / "real" / "inductor")
    assert is_restored(str(through_link), cache)


@pytest.mark.torch
def test_restored_libraries_load_here_and_every_other_goes_to_torch(tmp_path, monkeypatch):
    cpu_vec_isa = pytest.importorskip("torch._inductor.cpu_vec_isa")
    probe = layout(tmp_path)  # not a real library: loading it fails, as torch's child would report
    children = []

    def torch_child(self, path):
        children.append(path)
        return True

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", torch_child)  # monkeypatch puts torch's back
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert trust_restored_probes(env) and trust_restored_probes(env)
    patched = cpu_vec_isa.VecISA._probe_load
    assert patched.__wrapped__ is torch_child, "a second call wrapped the wrapper"
    assert patched(None, str(probe)) is False and children == []
    elsewhere = tmp_path / "elsewhere.so"
    assert patched(None, str(elsewhere)) is True and children == [str(elsewhere)]


@pytest.mark.parametrize("layers", [5, 1.5, True, {"inductor": 1}, "inductor"])
def test_a_marker_whose_layers_are_no_list_vouches_for_nothing(tmp_path, layers):
    """The marker lies in ROOT, which the model container writes: `"inductor" in 5` raised TypeError
    in the model's own torch process, at its first compile."""
    cache = tmp_path / "inductor"
    cache.mkdir()
    (tmp_path / RESTORE_MARKER).write_text(json.dumps({"status": "hit", "layers": layers}))
    assert restored_inductor_dir({"TORCHINDUCTOR_CACHE_DIR": str(cache)}) is None
