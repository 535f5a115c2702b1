"""Which GPUs a CUDA process would use: CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER over a fake node."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcache import gpus, probes
from kcache.errors import ConfigError

H100 = [gpus.Device(f"GPU-aaaa{i}-0000", "NVIDIA H100 80GB HBM3", "sm_90") for i in range(4)]
A10 = gpus.Device("GPU-bbbb0-0000", "NVIDIA A10", "sm_86")
MIXED = [H100[0], A10, H100[1]]  # NVML (PCI bus) order
MIG = gpus.Device(
    "MIG-cccc0-0000", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "sm_90", H100[0].uuid, f"MIG-{H100[0].uuid}/7/0"
)
PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def facts(devices, env):
    return probes.probe_gpu(env, read=lambda: gpus.Reading(tuple(devices), "570.124.06"))


def test_the_visible_device_is_keyed_not_device_0():
    # A pod given the A10 of a mixed node must not share a key with one given an H100.
    on_a10 = facts(MIXED, {**PCI, "CUDA_VISIBLE_DEVICES": "1"})
    assert on_a10 == {"gpu.name": "NVIDIA A10", "gpu.sm": "sm_86", "gpu.count": "1", "gpu.driver": "570.124.06"}
    assert facts(MIXED, {**PCI, "CUDA_VISIBLE_DEVICES": "0"})["gpu.sm"] == "sm_90"


def test_count_is_the_visible_count():
    assert facts(H100, {"CUDA_VISIBLE_DEVICES": "2,3"})["gpu.count"] == "2"
    assert facts(H100, {})["gpu.count"] == "4"


def test_differing_devices_are_listed_in_cuda_order():
    got = facts(MIXED, {**PCI, "CUDA_VISIBLE_DEVICES": "1,0"})
    assert got["gpu.name"] == "NVIDIA A10,NVIDIA H100 80GB HBM3" and got["gpu.sm"] == "sm_86,sm_90"
    assert facts(MIXED, {**PCI, "CUDA_VISIBLE_DEVICES": "0,1"})["gpu.sm"] == "sm_90,sm_86"


def test_empty_means_no_gpu_and_no_driver():
    assert facts(H100, {"CUDA_VISIBLE_DEVICES": ""}) == {
        "gpu.name": "none", "gpu.sm": "none", "gpu.count": "0", "gpu.driver": "none",
    }  # fmt: skip
    assert probes.probe_gpu({}, read=lambda: None)["gpu.count"] == "0"


def test_uuids_and_unique_prefixes_select_devices():
    assert gpus.visible(MIXED, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb0-0000"}) == (A10,)
    assert gpus.visible(MIXED, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa1"}) == (A10, H100[1])
    assert gpus.visible(MIXED, {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}) == ()  # ambiguous prefix: CUDA stops


def test_the_list_ends_at_the_first_unusable_entry():
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "1,7,2"}) == (H100[1],)
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "0,2,-1,1"}) == (H100[0], H100[2])  # CUDA's own example
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "2,x,0"}) == (H100[2],)
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "0,0,1"}) == (H100[0],)
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": " 3 , 1 "}) == (H100[3], H100[1])


def test_mig_instances_are_named_by_uuid():
    got = facts([H100[0], MIG, H100[1]], {"CUDA_VISIBLE_DEVICES": "MIG-cccc0-0000"})
    assert got["gpu.name"] == "NVIDIA H100 80GB HBM3 MIG 1g.10gb" and got["gpu.count"] == "1"
    assert gpus.visible([H100[0], MIG], {}) == (H100[0],)  # instances only when named
    assert gpus.visible([H100[0], MIG], {"CUDA_VISIBLE_DEVICES": f"MIG-{H100[0].uuid}/7/0"}) == (MIG,)
    assert gpus.visible([H100[0], MIG], {"CUDA_VISIBLE_DEVICES": f"MIG-{H100[0].uuid}/1/0"}) == ()


def test_fastest_first_on_a_mixed_node():
    # All visible: the set is known, CUDA's order is not; a fixed order keeps the key stable.
    assert facts(MIXED, {}) == facts(list(reversed(MIXED)), {})
    assert facts(MIXED, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb0"})["gpu.name"] == "NVIDIA A10"
    with pytest.raises(ConfigError, match="PCI_BUS_ID"):
        facts(MIXED, {"CUDA_VISIBLE_DEVICES": "0"})
    # Alike devices: any order gives the same facts, so indices are fine.
    assert facts(H100, {"CUDA_VISIBLE_DEVICES": "1"})["gpu.count"] == "1"


@given(st.lists(st.sampled_from(range(len(MIXED))), unique=True), st.permutations(MIXED))
def test_visible_devices_decide_the_facts_not_the_node(chosen, node):
    """Two pods see the same devices in the same CUDA order -> the same facts, whatever else the node holds."""
    env = {**PCI, "CUDA_VISIBLE_DEVICES": ",".join(MIXED[i].uuid for i in chosen)}
    alone = [MIXED[i] for i in chosen]
    assert facts(node, env) == facts(alone, {} if len({(d.name, d.sm) for d in alone}) <= 1 else PCI)
