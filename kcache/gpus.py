"""The GPUs a CUDA process started with this environment would use, and the facts they give.

    read()   the node's devices as NVML lists them (index order = PCI bus order), else nvidia-smi's
       │
    visible(devices, env)   CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER applied, in CUDA's order
       │
    facts()  gpu.name, gpu.sm (one value when all alike, else per device, comma-joined),
             gpu.count (visible devices), gpu.driver

Selection is pure so that tests feed it device lists: no GPU, NVML or driver needed.

CUDA_VISIBLE_DEVICES, as the CUDA driver reads it: unset means every device; an empty string
means none; otherwise a comma-separated list of indices, `GPU-<uuid>` (a unique prefix is
enough) or `MIG-<uuid>` (or the older `MIG-<GPU uuid>/<gi>/<ci>`) entries, and the list ends at
the first entry that names no device: "0,2,-1,1" is devices 0 and 2. Measured with the driver
(cuInit, cuDeviceGetCount) on an H200: an index is read as C's strtoul reads it, so "0abc",
"+0", "-0", "0x1" and "0 1" are device 0 and "-1" none; an index list ends at a uuid entry and a
uuid list at an index; a `GPU-` entry must start so ("gpu-…" and " GPU-…" name nothing), its hex
digits match in either case with dashes skipped, and anything after the whole uuid is ignored; a
GPU named twice ("0,0", "0,0abc") leaves the process no device at all (CUDA_ERROR_INVALID_DEVICE).

MIG: a GPU in MIG mode is no CUDA device; its instances are, and a process uses only the first
MIG instance it is given (a MIG pod in Kubernetes, CUDA_VISIBLE_DEVICES unset, sees the parent and
its own instance in NVML, and torch counts one device named "<GPU> MIG 1g.5gb"). So unset means the
GPUs not in MIG mode plus the first instance NVML lists; later `MIG-` entries are ignored; an index
or `GPU-` entry naming a GPU in MIG mode is refused (name the instance). An instance keeps its own
name (its profile) and its parent's SM. On a node mixing MIG and whole GPUs, where CUDA's numbering
is not measured here, indices count NVML's GPUs, those in MIG mode included.

Indices count in CUDA_DEVICE_ORDER: PCI_BUS_ID is NVML's order. The default,
FASTEST_FIRST, puts a heuristic's fastest device first and leaves the rest "unspecified": on a
node whose devices are all alike that is the same facts in any order; on a mixed node kcache keys
every device in a fixed sorted order when all are visible (the same hardware gives the same
heuristic choice), and refuses indices, whose meaning it cannot know (name GPUs by UUID, or set
CUDA_DEVICE_ORDER=PCI_BUS_ID).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kcache.errors import ConfigError

log = logging.getLogger(__name__)

NONE = "none"
# GPUs this container has (device nodes) that neither NVML nor nvidia-smi could read: no bundle is
# published under it, so a restore misses rather than hit another GPU's kernels under "none".
UNKNOWN = "unknown"
UNKNOWN_FACTS = {"gpu.name": UNKNOWN, "gpu.sm": UNKNOWN, "gpu.count": UNKNOWN, "gpu.driver": UNKNOWN}
_DEVICE_NODE = re.compile(r"nvidia[0-9]+")  # a GPU; nvidiactl, nvidia-uvm and nvidia-modeset are not


@dataclass(frozen=True)
class Device:
    """One CUDA device: a whole GPU, or a MIG instance (`parent` is then its GPU's uuid)."""

    uuid: str  # "GPU-…" or "MIG-…"
    name: str
    sm: str  # "sm_90"
    parent: str | None = None
    legacy_id: str | None = None  # a MIG instance's pre-R470 name, "MIG-<GPU uuid>/<gi>/<ci>"
    mig_mode: bool = False  # a whole GPU with MIG on: CUDA sees its instances, never the GPU itself


@dataclass(frozen=True)
class Reading:
    """What the driver reports for the node: devices in NVML index order, and the driver version."""

    devices: tuple[Device, ...]
    driver: str


def visible(devices: Sequence[Device], env: Mapping[str, str]) -> tuple[Device, ...]:
    """The devices CUDA would enumerate, in its order."""
    in_mig = {d.parent for d in devices if d.parent is not None} | {d.uuid for d in devices if d.mig_mode}
    whole = [d for d in devices if d.parent is None]
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        cuda = [d for d in devices if d.uuid not in in_mig and (d.parent is None or d is _first_mig(devices))]
        ordered = _cuda_order(cuda, env)
        return tuple(ordered if ordered is not None else sorted(cuda, key=lambda d: (d.name, d.sm, d.uuid)))
    ordered = _cuda_order(whole, env)
    chosen: list[Device] = []
    entries = spec.split(",")
    for entry in entries:
        if _names_by_uuid(entry) != _names_by_uuid(entries[0]):
            break  # a list of indices ends at a uuid, and one of uuids at an index
        device = _lookup(entry, whole, devices, ordered, env)
        if device is None:
            break  # CUDA stops at the first entry it cannot use
        if device in chosen:
            if device.parent is None:
                return ()  # a GPU named twice: CUDA fails to start (CUDA_ERROR_INVALID_DEVICE), no device
            break
        if device.uuid in in_mig:
            why = (f"names GPU {device.uuid}, which is in MIG mode and so no CUDA device; "
                   "name its MIG instance by its MIG- uuid (nvidia-smi -L) or leave the variable unset")  # fmt: skip
            raise ConfigError("CUDA_VISIBLE_DEVICES", spec, why)
        if device.parent is None or _first_mig(chosen) is None:
            chosen.append(device)  # CUDA uses the first MIG instance it is given and ignores the others
    return tuple(chosen)


def _first_mig(devices: Sequence[Device]) -> Device | None:
    return next((d for d in devices if d.parent is not None), None)


def _cuda_order(cuda: list[Device], env: Mapping[str, str]) -> list[Device] | None:
    """Devices by CUDA index, or None when CUDA's numbering cannot be known (see the module doc)."""
    if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") == "PCI_BUS_ID":
        return cuda
    if len({(d.name, d.sm) for d in cuda}) <= 1:
        return cuda
    return None


def _lookup(entry: str, whole, devices, ordered, env) -> Device | None:
    if entry.startswith("GPU-"):
        exact = [d for d in whole if d.uuid == entry]
        return _unique(exact or [d for d in whole if _names_gpu(entry, d.uuid)])
    if _names_by_uuid(entry):  # MIG-, read as before: no driver with MIG has been measured here
        mig = entry.strip()
        exact = [d for d in devices if mig in (d.uuid, d.legacy_id)]
        return _unique(exact or [d for d in devices if d.uuid.lower().startswith(mig.lower())])
    index = _index(entry)
    if index is None:
        return None
    if ordered is None:
        why = ("names GPUs by index on a node with mixed GPUs, where CUDA's default FASTEST_FIRST numbering "
               "is unknown; name them by UUID or set CUDA_DEVICE_ORDER=PCI_BUS_ID")  # fmt: skip
        raise ConfigError("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"], why)
    return ordered[index] if index < len(ordered) else None


def _unique(matches: list[Device]) -> Device | None:
    return matches[0] if len(matches) == 1 else None  # an ambiguous prefix names no device


def _names_by_uuid(entry: str) -> bool:
    return entry.startswith("GPU-") or entry.strip().upper().startswith("MIG-")


def _index(entry: str) -> int | None:
    """The index C's strtoul reads at the start of `entry`, as CUDA reads one; None when it reads no
    digits or a negative number (strtoul wraps -1 round to a count no node has)."""
    text = entry.lstrip(" \t\n\v\f\r")  # what C's isspace skips
    sign = text[:1] if text[:1] in ("+", "-") else ""
    rest = text[len(sign) :]
    digits = rest[: len(rest) - len(rest.lstrip("0123456789"))]  # ASCII only: "²".isdigit() is true
    if not digits or (sign == "-" and digits.strip("0")):
        return None
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 9 else 10**9  # int() refuses more than 4300 digits


def _names_gpu(entry: str, uuid: str) -> bool:
    """Whether a `GPU-` entry names the GPU with `uuid` as CUDA reads it: the entry's digits, dashes
    skipped and in either case, begin the uuid's; what follows the whole uuid is ignored."""
    ours = uuid[4:].replace("-", "").lower()
    given = entry[4:].replace("-", "").lower()[: len(ours)]
    return bool(given) and ours.startswith(given)


def facts(reading: Reading | None, env: Mapping[str, str]) -> dict[str, str]:
    """gpu.* facts for the devices this environment makes visible (none: a CPU-only process)."""
    shown = visible(reading.devices, env) if reading is not None else ()
    if not shown:
        # No GPU in use: GPU kernels are neither built nor run, so the driver does not matter.
        return {"gpu.name": NONE, "gpu.sm": NONE, "gpu.count": "0", "gpu.driver": NONE}
    out = {
        "gpu.name": _joined(d.name for d in shown),
        "gpu.sm": _joined(d.sm for d in shown),
        "gpu.count": str(len(shown)),
        "gpu.driver": reading.driver,
    }
    if _sorted_order(reading.devices, env, shown):
        # The sorted list of a FASTEST_FIRST mixed node can read like another node's real CUDA order
        # (PCI_BUS_ID, or UUIDs listed): device 0, which the model compiles for, differs between them.
        out["gpu.order"] = "sorted"
    return out


def _sorted_order(devices: Sequence[Device], env: Mapping[str, str], shown: Sequence[Device]) -> bool:
    return env.get("CUDA_VISIBLE_DEVICES") is None and len({(d.name, d.sm) for d in shown}) > 1 and \
        _cuda_order([d for d in devices if d in shown], env) is None


def hides_every_device(env: Mapping[str, str]) -> bool:
    """Whether CUDA_VISIBLE_DEVICES leaves this process no device on any node: empty, or a first entry
    that names none (CUDA stops at the first entry it cannot use: "-1")."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return False
    first = spec.split(",")[0]
    return _index(first) is None and not _names_by_uuid(first)


def devices_present(dev: Path = Path("/dev")) -> bool:
    """Whether this container was given GPU device nodes (/dev/nvidia0...), read or not."""
    try:
        return any(_DEVICE_NODE.fullmatch(name) for name in os.listdir(dev))
    except OSError:
        return False


def _joined(values) -> str:
    values = list(values)
    return values[0] if len(set(values)) == 1 else ",".join(values)


# ---- reading the node ---------------------------------------------------------------------------


def read() -> Reading | None:
    """The node's devices: NVML first, then nvidia-smi, else None (no driver visible)."""
    return _read_nvml() or _read_nvidia_smi()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_nvml() -> Reading | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound and friends: no driver here
        return None
    try:
        devices: list[Device] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            devices += _nvml_device(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i))
        return Reading(tuple(devices), _text(pynvml.nvmlSystemGetDriverVersion())) if devices else None
    except Exception as exc:
        log.debug("NVML query failed: %s", exc)
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_device(pynvml, handle) -> list[Device]:
    """A GPU, followed by the MIG instances NVML shows this process when MIG mode is on."""
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    uuid, name = _text(pynvml.nvmlDeviceGetUUID(handle)), _text(pynvml.nvmlDeviceGetName(handle))
    sm = f"sm_{major}{minor}"
    try:
        mig_mode = pynvml.nvmlDeviceGetMigMode(handle)[0] == 1  # [current, pending]; 1 is NVML_DEVICE_MIG_ENABLE
    except pynvml.NVMLError:  # no MIG support on this GPU
        mig_mode = False
    found = [Device(uuid, name, sm, mig_mode=mig_mode)]
    if not mig_mode:
        return found
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError:
            continue  # an empty slot, or an instance another pod was given
        gi, ci = pynvml.nvmlDeviceGetGpuInstanceId(mig), pynvml.nvmlDeviceGetComputeInstanceId(mig)
        # An instance's own name carries its profile ("... MIG 1g.5gb"), as torch's device name does;
        # it runs on its parent's SM architecture.
        found.append(Device(_text(pynvml.nvmlDeviceGetUUID(mig)), _text(pynvml.nvmlDeviceGetName(mig)), sm, uuid,
                            f"MIG-{uuid}/{gi}/{ci}"))  # fmt: skip
    return found


def _read_nvidia_smi() -> Reading | None:
    """GPUs with their MIG mode from --query-gpu, MIG instances from -L (nvidia-smi's order is NVML's)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    query = [smi, "--query-gpu=uuid,name,compute_cap,driver_version,mig.mode.current", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return _parse_nvidia_smi(out, listing)


_SMI_GPU = re.compile(r"^GPU \d+: .*\(UUID: (GPU-[^)\s]+)\)")
_SMI_MIG = re.compile(r"^\s+(MIG \S+)\s+Device\s+\d+: \(UUID: (MIG-[^)\s]+)\)")


def _parse_nvidia_smi(query: str, listing: str) -> Reading | None:
    rows = [[c.strip() for c in line.split(",")] for line in query.splitlines() if line.strip()]
    if not rows or any(len(row) != 5 for row in rows):
        return None
    instances: dict[str, list[tuple[str, str]]] = {}  # GPU uuid -> [(profile, MIG uuid)]
    parent = None
    for line in listing.splitlines():
        if gpu := _SMI_GPU.match(line):
            parent = gpu.group(1)
        elif (mig := _SMI_MIG.match(line)) and parent is not None:
            instances.setdefault(parent, []).append((mig.group(1), mig.group(2)))
    devices: list[Device] = []
    for uuid, name, cap, _, mode in rows:
        sm = "sm_" + cap.replace(".", "")
        devices.append(Device(uuid, name, sm, mig_mode=mode == "Enabled"))
        for profile, mig_uuid in instances.get(uuid, []) if mode == "Enabled" else ():
            legacy = mig_uuid if "/" in mig_uuid else None  # drivers before R470 name instances MIG-<GPU uuid>/gi/ci
            devices.append(Device(mig_uuid, f"{name} {profile}", sm, uuid, legacy))
    return Reading(tuple(devices), rows[0][3])
