"""A fact kcache could not read is never filed as an absent one.

An image whose kcache cannot see torch (a venv of its own) or cannot read its GPUs (no NVML, no
nvidia-smi: NVIDIA_DRIVER_CAPABILITIES=compute) probes the same facts on every machine. Kernels
published under such facts would hit on any other torch or GPU, so the GPU facts say `unknown`
when device nodes show GPUs the probe cannot read, and publish refuses both cases.
"""

from __future__ import annotations

import pytest
from fixed_facts import FACTS
from trees import write_tree

from kcache import fingerprint, gpus, probes
from kcache.errors import ConfigError
from kcache.publish import publish
from kcache.sources import builtin

H100 = gpus.Reading((gpus.Device("GPU-1", "NVIDIA H100 80GB HBM3", "sm_90"),), "570.124.06")


def test_gpu_device_nodes_without_a_reader_are_unknown_not_none():
    got = probes.probe_gpu({}, read=lambda: None, present=lambda: True)
    assert got == {"gpu.name": "unknown", "gpu.sm": "unknown", "gpu.count": "unknown", "gpu.driver": "unknown"}
    assert probes.probe_gpu({}, read=lambda: None, present=lambda: False)["gpu.count"] == "0"
    assert probes.probe_gpu({}, read=lambda: H100, present=lambda: True)["gpu.sm"] == "sm_90"


@pytest.mark.parametrize("hidden", ["", "-1", " ", "none"])
def test_unread_gpus_that_cuda_visible_devices_hides_are_no_gpu(hidden):
    """A CPU-only workload on a GPU node: CUDA sees no device whatever the node holds."""
    got = probes.probe_gpu({"CUDA_VISIBLE_DEVICES": hidden}, read=lambda: None, present=lambda: True)
    assert got["gpu.count"] == "0" and got["gpu.sm"] == "none"
    assert probes.probe_gpu({"CUDA_VISIBLE_DEVICES": "0"}, read=lambda: None, present=lambda: True)["gpu.count"] == \
        "unknown"  # fmt: skip


def test_an_unreadable_gpu_vouches_for_nothing_in_a_facts_file_check(monkeypatch):
    assert probes.check_gpu({}, read=lambda: None, present=lambda: True) == {}


def test_device_nodes_are_gpus_and_control_nodes_are_not(tmp_path):
    dev = tmp_path / "dev"
    write_tree(dev, {"nvidiactl": b"", "nvidia-uvm": b"", "nvidia-modeset": b""})
    assert not gpus.devices_present(dev)
    write_tree(dev, {"nvidia0": b""})
    assert gpus.devices_present(dev)


def _root(tmp_path, files):
    write_tree(tmp_path / "root", files)
    return tmp_path / "root"


def test_publish_refuses_unknown_gpu_facts(tmp_path, store, sqlite_index):
    facts = {**FACTS, "gpu.name": "unknown", "gpu.sm": "unknown", "gpu.count": "unknown", "gpu.driver": "unknown"}
    root = _root(tmp_path, {"triton/abc/k.cubin": b"x"})
    with pytest.raises(ConfigError, match="gpu.sm"):
        publish(store, sqlite_index, fingerprint.compute(facts), builtin(), root=root, env={})
    assert sqlite_index.newest_bundle(fingerprint.compute(facts).bundle_key) is None


@pytest.mark.parametrize("layer", ["inductor", "megacache", "torch_extensions", "vllm"])
def test_publish_refuses_torch_built_kernels_without_a_torch_fact(tmp_path, store, sqlite_index, layer):
    source = next(s for s in builtin() if s.name == layer)
    root = _root(tmp_path, {f"{source.restore_dir(tmp_path / 'root').relative_to(tmp_path / 'root')}/x/k.so": b"x"})
    fp = fingerprint.compute({**FACTS, "torch.version": "none"})
    with pytest.raises(ConfigError, match=f"torch.version.*{layer}"):
        publish(store, sqlite_index, fp, builtin(), root=root, env={})
    assert sqlite_index.newest_bundle(fp.bundle_key) is None


def test_kernels_that_need_no_torch_still_publish_without_it(tmp_path, store, sqlite_index):
    root = _root(tmp_path, {"triton/abc/k.cubin": b"x"})
    fp = fingerprint.compute({**FACTS, "torch.version": "none"})
    result = publish(store, sqlite_index, fp, builtin(), root=root, env={})
    assert tuple(result.layers) == ("triton",)


A100 = gpus.Device("GPU-a", "NVIDIA A100-SXM4-80GB", "sm_80")
H100_DEV = gpus.Device("GPU-h", "NVIDIA H100 80GB HBM3", "sm_90")


def test_a_mixed_nodes_sorted_devices_never_read_as_a_known_cuda_order():
    """FASTEST_FIRST on a mixed node keys the devices sorted; PCI_BUS_ID or a UUID list may give the
    same list in CUDA's real order, with another device 0: the two must not share a key."""
    node = gpus.Reading((A100, H100_DEV), "570.124.06")
    unknown = gpus.facts(node, {})
    by_bus = gpus.facts(node, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    by_uuid = gpus.facts(node, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-h"})
    assert by_bus == by_uuid and unknown != by_bus
    assert {k: v for k, v in unknown.items() if k != "gpu.order"} == by_bus
    alike = gpus.Reading((A100, gpus.Device("GPU-b", A100.name, A100.sm)), "570.124.06")
    assert "gpu.order" not in gpus.facts(alike, {})
