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
H100_MIG = gpus.Device(H100[0].uuid, H100[0].name, "sm_90", mig_mode=True)
A100 = gpus.Device("GPU-dddd0-0000", "NVIDIA A100-SXM4-40GB", "sm_80")
A100_MIG = gpus.Device(A100.uuid, A100.name, A100.sm, mig_mode=True)  # MIG mode on: not itself a CUDA device
A100_1G = gpus.Device("MIG-eeee0-0000", "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "sm_80", A100.uuid, f"MIG-{A100.uuid}/7/0")
A100_3G = gpus.Device("MIG-eeee1-0000", "NVIDIA A100-SXM4-40GB MIG 3g.20gb", "sm_80", A100.uuid, f"MIG-{A100.uuid}/2/0")
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
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": " 3 , 1 "}) == (H100[3], H100[1])
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "0,\u00b2"}) == (H100[0],)  # "²".isdigit(), no index
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "1," + "9" * 4400}) == (H100[1],)  # past int()'s digits


# Measured with the CUDA driver (cuInit, cuDeviceGetCount) on one H200 whose uuid had this shape.
H200 = gpus.Device("GPU-5a1d0c3e-7b2f-4e8a-9c61-0d2e4f6a8b90", "NVIDIA H200", "sm_90")


def test_entries_are_read_as_the_cuda_driver_reads_them():
    """An index is read as C's strtoul reads it ("0abc", "+0", "0x1", "1 2" name a device), a device
    named twice leaves no device at all, and a uuid entry must start with "GPU-" as written."""
    for spec, index in (("0abc", 0), ("+1", 1), (" +2", 2), ("-0", 0), ("0x1", 0), ("1 2", 1), ("00", 0)):
        assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": spec}) == (H100[index],), spec
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "3gpu,1"}) == (H100[3], H100[1])
    for spec in ("0,0", "0, 0", "1,0,1abc", f"{H200.uuid},{H200.uuid}"):  # CUDA_ERROR_INVALID_DEVICE
        assert gpus.visible([H200, *H100[1:]], {**PCI, "CUDA_VISIBLE_DEVICES": spec}) == (), spec
    assert gpus.visible(H100, {"CUDA_VISIBLE_DEVICES": "0,,0"}) == (H100[0],)  # the list ended first
    assert gpus.visible([H200], {"CUDA_VISIBLE_DEVICES": f"0,{H200.uuid}"}) == (H200,)
    assert gpus.visible([H200], {"CUDA_VISIBLE_DEVICES": f"{H200.uuid},0abc"}) == (H200,)
    # uuids: hex digits in either case, dashes skipped, anything after the whole uuid ignored
    for spec in ("GPU-5A1D0C3E", "GPU--5a1d0c3e", H200.uuid + "x", H200.uuid + " ", "GPU-5"):
        assert gpus.visible([H200, A10], {"CUDA_VISIBLE_DEVICES": spec}) == (H200,), spec
    for spec in ("gpu-5a1d0c3e", " GPU-5a1d0c3e", "GPU-5a1d0c3ezz", "GPU-"):
        assert gpus.visible([H200], {"CUDA_VISIBLE_DEVICES": spec}) == (), spec
    # MIG entries are read as before (no MIG node measured): spaces around them are dropped
    assert gpus.visible([A100_MIG, A100_1G], {"CUDA_VISIBLE_DEVICES": f" {A100_1G.uuid} "}) == (A100_1G,)


def test_an_index_cuda_reads_is_never_keyed_as_no_gpu():
    """A pod on an A100 and one on an H100, both with CUDA_VISIBLE_DEVICES=+0, compile for their own GPU."""
    on_a100, on_h100 = (facts([gpu], {"CUDA_VISIBLE_DEVICES": "+0"}) for gpu in (A100, H100[0]))
    assert (on_a100["gpu.sm"], on_h100["gpu.sm"]) == ("sm_80", "sm_90")
    assert not gpus.hides_every_device({"CUDA_VISIBLE_DEVICES": "0abc"})
    assert gpus.hides_every_device({"CUDA_VISIBLE_DEVICES": "gpu-5a1d0c3e"})


def test_mig_instances_are_named_by_uuid():
    got = facts([H100_MIG, MIG, H100[1]], {"CUDA_VISIBLE_DEVICES": "MIG-cccc0-0000"})
    assert got["gpu.name"] == "NVIDIA H100 80GB HBM3 MIG 1g.10gb" and got["gpu.count"] == "1"
    assert gpus.visible([H100_MIG, MIG], {"CUDA_VISIBLE_DEVICES": f"MIG-{H100[0].uuid}/7/0"}) == (MIG,)
    assert gpus.visible([H100_MIG, MIG], {"CUDA_VISIBLE_DEVICES": f"MIG-{H100[0].uuid}/1/0"}) == ()


def test_a_mig_pod_is_keyed_as_its_instance_not_the_whole_gpu():
    # Kubernetes leaves CUDA_VISIBLE_DEVICES unset; NVML lists the parent and the pod's instance.
    slice_1g, slice_3g, whole = (facts(node, {}) for node in ([A100_MIG, A100_1G], [A100_MIG, A100_3G], [A100]))
    assert slice_1g == {"gpu.name": "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "gpu.sm": "sm_80", "gpu.count": "1",
                        "gpu.driver": "570.124.06"}  # fmt: skip
    assert slice_3g["gpu.name"] == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert whole["gpu.name"] == "NVIDIA A100-SXM4-40GB" and len({str(slice_1g), str(slice_3g), str(whole)}) == 3


def test_cuda_uses_only_the_first_mig_instance():
    two = [A100_MIG, A100_1G, A100_3G]
    assert gpus.visible(two, {}) == (A100_1G,)
    assert gpus.visible(two, {"CUDA_VISIBLE_DEVICES": f"{A100_3G.uuid},{A100_1G.uuid}"}) == (A100_3G,)
    assert facts(two, {"CUDA_VISIBLE_DEVICES": f"{A100_1G.uuid},{A100_3G.uuid}"})["gpu.count"] == "1"


def test_a_gpu_in_mig_mode_is_no_cuda_device():
    assert facts([A100_MIG], {})["gpu.count"] == "0"  # MIG on, no instance given to this pod
    assert gpus.visible([A100_MIG, A100_1G, A10], PCI) == (A100_1G, A10)
    assert gpus.visible([A100, A100_1G], {}) == (A100_1G,)  # an instance's parent is in MIG mode, flagged or not
    for named in ("0", A100_MIG.uuid, "GPU-dddd"):
        with pytest.raises(ConfigError, match="MIG-"):  # the hint: name the instance
            gpus.visible([A100_MIG, A100_1G], {**PCI, "CUDA_VISIBLE_DEVICES": named})


class FakeNvml:
    """pynvml's calls over one GPU handle (a string); `slots` maps MIG slots to (uuid, name, gi, ci)."""

    class NVMLError(Exception):
        pass

    def __init__(self, mig_mode, slots=None):
        self.mig_mode, self.slots = mig_mode, slots or {}

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return (8, 0)

    def nvmlDeviceGetUUID(self, handle):
        return A100.uuid.encode() if handle == "gpu" else self.slots[handle][0]

    def nvmlDeviceGetName(self, handle):
        return A100.name.encode() if handle == "gpu" else self.slots[handle][1]

    def nvmlDeviceGetMigMode(self, handle):
        if self.mig_mode is None:
            raise self.NVMLError("Not Supported")
        return [self.mig_mode, self.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        if slot not in self.slots:
            raise self.NVMLError("Not Found")
        return slot

    def nvmlDeviceGetGpuInstanceId(self, mig):
        return self.slots[mig][2]

    def nvmlDeviceGetComputeInstanceId(self, mig):
        return self.slots[mig][3]


def test_nvml_reads_mig_mode_and_the_instances_by_their_own_names():
    nvml = FakeNvml(1, {2: (A100_1G.uuid, A100_1G.name, 7, 0)})
    parent, instance = gpus._nvml_device(nvml, "gpu")
    assert parent == A100_MIG and instance == A100_1G
    assert facts([parent, instance], {})["gpu.name"] == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    assert gpus._nvml_device(FakeNvml(0), "gpu") == [A100]
    assert gpus._nvml_device(FakeNvml(None), "gpu") == [A100]  # no MIG support
    assert gpus._nvml_device(FakeNvml(1), "gpu") == [A100_MIG]  # MIG on, no instance visible here


SMI_QUERY = """\
GPU-dddd0-0000, NVIDIA A100-SXM4-40GB, 8.0, 570.124.06, Enabled
GPU-bbbb0-0000, NVIDIA A10, 8.6, 570.124.06, [N/A]
"""
SMI_LIST = """\
GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-dddd0-0000)
  MIG 1g.5gb      Device  0: (UUID: MIG-eeee0-0000)
GPU 1: NVIDIA A10 (UUID: GPU-bbbb0-0000)
"""


def test_nvidia_smi_lists_mig_mode_and_instances():
    reading = gpus._parse_nvidia_smi(SMI_QUERY, SMI_LIST)
    assert reading == gpus.Reading((A100_MIG, gpus.Device(A100_1G.uuid, A100_1G.name, "sm_80", A100.uuid), A10),
                                   "570.124.06")  # fmt: skip
    assert gpus.facts(reading, {"CUDA_VISIBLE_DEVICES": A100_1G.uuid})["gpu.name"] == A100_1G.name
    old_driver = SMI_LIST.replace("MIG-eeee0-0000", f"MIG-{A100.uuid}/7/0")
    legacy = gpus._parse_nvidia_smi(SMI_QUERY, old_driver).devices[1]
    assert legacy.uuid == legacy.legacy_id == f"MIG-{A100.uuid}/7/0" and legacy.parent == A100.uuid
    assert gpus._parse_nvidia_smi(SMI_QUERY, "").devices == (A100_MIG, A10)


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
