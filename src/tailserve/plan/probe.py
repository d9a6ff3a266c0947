"""Read-only probes of the host and its GPUs for `tailserve doctor`: sysfs, /proc, env, NVML.

Only reads. Never calls an NVML setter, never writes a file; every probe that fails yields None
("unknown") rather than an exception, so one unsupported query cannot hide the rest of the report.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")

# NVML clock-event ("throttle") reason bits, stable across driver versions (nvml.h).
THROTTLE_REASONS = MappingProxyType(
    {
        0x1: "gpu_idle",
        0x2: "applications_clocks_setting",
        0x4: "sw_power_cap",
        0x8: "hw_slowdown",
        0x10: "sync_boost",
        0x20: "sw_thermal_slowdown",
        0x40: "hw_thermal_slowdown",
        0x80: "hw_power_brake_slowdown",
        0x100: "display_clock_setting",
    }
)


@dataclass(frozen=True)
class HostView:
    """What the doctor needs to know about the host, read once."""

    cpu_affinity: frozenset[int]  # CPUs this process may run on
    numa_cpus: Mapping[int, frozenset[int]]  # NUMA node -> its CPUs (empty when sysfs lacks it)
    governors: Mapping[int, str]  # CPU -> cpufreq governor, for CPUs that expose one
    environ: Mapping[str, str]  # the CUDA-related environment variables that are set
    mps_running: bool
    nvidia_driver_present: bool


@dataclass(frozen=True)
class GpuView:
    """One GPU as NVML reports it; None means the query is unsupported or failed."""

    index: int
    name: str
    memory_total_bytes: int | None
    sm_clock_mhz: int | None
    sm_clock_max_mhz: int | None
    mem_clock_mhz: int | None
    mem_clock_max_mhz: int | None
    throttle_reasons: tuple[str, ...] | None
    persistence_mode: bool | None
    mig_current: bool | None
    mig_pending: bool | None
    ecc_current: bool | None
    ecc_pending: bool | None
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None
    pci_bus_id: str | None
    numa_node: int | None
    near_cpus: frozenset[int] | None  # CPUs NVML or sysfs call local to this GPU


@dataclass(frozen=True)
class NvmlProbe:
    """The outcome of asking NVML: the GPUs, or why there are none."""

    status: str  # "ok", "not_installed", "no_driver" or "error"
    detail: str
    driver_version: str | None
    gpus: tuple[GpuView, ...]


CUDA_ENV_VARS = (
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)


def parse_cpulist(text: str) -> frozenset[int]:
    """CPUs from a kernel cpulist such as "0-3,8-11" (empty set for empty text)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _read(path: Path) -> str | None:
    """A small text file's content, or None if it cannot be read."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _numa_cpus(root: Path) -> dict[int, frozenset[int]]:
    """NUMA node -> CPUs from /sys/devices/system/node."""
    nodes: dict[int, frozenset[int]] = {}
    for node_dir in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        cpulist = _read(node_dir / "cpulist")
        if cpulist is not None:
            nodes[int(node_dir.name.removeprefix("node"))] = parse_cpulist(cpulist)
    return nodes


def _governors(root: Path) -> dict[int, str]:
    """CPU -> scaling governor from /sys/devices/system/cpu/cpu*/cpufreq."""
    governors: dict[int, str] = {}
    for cpu_dir in (root / "sys/devices/system/cpu").glob("cpu[0-9]*"):
        governor = _read(cpu_dir / "cpufreq/scaling_governor")
        if governor is not None:
            governors[int(cpu_dir.name.removeprefix("cpu"))] = governor
    return governors


def _mps_running(root: Path, environ: Mapping[str, str]) -> bool:
    """An MPS control daemon or server in /proc, or its control pipe in the MPS pipe directory."""
    for comm in (root / "proc").glob("[0-9]*/comm"):
        if (_read(comm) or "").startswith("nvidia-cuda-mps"):  # comm is cut at 15 chars
            return True
    pipe_dir = environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return (root / pipe_dir.lstrip("/") / "control").exists()


def read_host(
    root: Path = Path("/"),
    environ: Mapping[str, str] | None = None,
    cpu_affinity: frozenset[int] | None = None,
) -> HostView:
    """Read the host; `root` lets tests point every /sys and /proc read at a fake tree."""
    env = os.environ if environ is None else environ
    affinity = cpu_affinity if cpu_affinity is not None else frozenset(os.sched_getaffinity(0))
    return HostView(
        cpu_affinity=affinity,
        numa_cpus=MappingProxyType(_numa_cpus(root)),
        governors=MappingProxyType(_governors(root)),
        environ=MappingProxyType({k: env[k] for k in CUDA_ENV_VARS if k in env}),
        mps_running=_mps_running(root, env),
        nvidia_driver_present=(root / "proc/driver/nvidia/version").exists()
        or (root / "dev/nvidia0").exists(),
    )


def _try(call: Callable[..., T], *args: Any) -> T | None:
    """NVML call result, or None when the GPU / driver does not support it (NVMLError and friends)."""
    try:
        return call(*args)
    except Exception:  # pynvml raises per-status NVMLError subclasses; any failure means "unknown"
        return None


def _text(value: Any) -> str:
    """NVML strings are bytes in old pynvml releases and str in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML "00000000:3B:00.0" -> sysfs "0000:3b:00.0"."""
    domain, _, rest = nvml_bus_id.lower().partition(":")
    return f"{domain[-4:]}:{rest}"


def _bits_to_cpus(words: Any) -> frozenset[int]:
    """CPUs from NVML's affinity bitmask (an array of 64-bit words, lowest CPUs first)."""
    return frozenset(w * 64 + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1)


def _flag(pair: Any, index: int) -> bool | None:
    """Item `index` of an NVML (current, pending) pair as a bool."""
    return None if pair is None else bool(pair[index])


def _reasons(nvml: Any, handle: Any) -> tuple[str, ...] | None:
    """Active clock-event reasons by name (the query was renamed in newer NVML)."""
    getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    mask = None if getter is None else _try(getter, handle)
    if mask is None:
        return None
    return tuple(name for bit, name in THROTTLE_REASONS.items() if int(mask) & bit)


def _gpu_numa(nvml: Any, handle: Any, bus_id: str | None, root: Path) -> int | None:
    """The GPU's NUMA node from NVML, else from sysfs; None on single-node or unknown hosts."""
    node = _try(getattr(nvml, "nvmlDeviceGetNumaNodeId", lambda _h: None), handle)
    if node is None and bus_id:
        text = _read(root / "sys/bus/pci/devices" / _sysfs_bus_id(bus_id) / "numa_node")
        node = int(text) if text and text.lstrip("-").isdigit() else None
    return None if node is None or int(node) < 0 else int(node)


def read_gpu(nvml: Any, index: int, host: HostView, root: Path) -> GpuView:
    """Every doctor-relevant NVML query for GPU `index` (reads only)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    sm, mem = getattr(nvml, "NVML_CLOCK_SM", 1), getattr(nvml, "NVML_CLOCK_MEM", 2)
    memory = _try(nvml.nvmlDeviceGetMemoryInfo, handle)
    pci = _try(nvml.nvmlDeviceGetPciInfo, handle)
    bus_id = _text(pci.busId) if pci is not None else None
    numa = _gpu_numa(nvml, handle, bus_id, root)
    near = host.numa_cpus.get(numa) if numa is not None else None
    if near is None:
        words = _try(nvml.nvmlDeviceGetCpuAffinity, handle, max(1, (os.cpu_count() or 64) // 64 + 1))
        near = _bits_to_cpus(words) if words is not None else None
    persistence = _try(nvml.nvmlDeviceGetPersistenceMode, handle)
    mig = _try(nvml.nvmlDeviceGetMigMode, handle)
    ecc = _try(nvml.nvmlDeviceGetEccMode, handle)
    return GpuView(
        index=index,
        name=_text(_try(nvml.nvmlDeviceGetName, handle) or "unknown GPU"),
        memory_total_bytes=int(memory.total) if memory is not None else None,
        sm_clock_mhz=_try(nvml.nvmlDeviceGetClockInfo, handle, sm),
        sm_clock_max_mhz=_try(nvml.nvmlDeviceGetMaxClockInfo, handle, sm),
        mem_clock_mhz=_try(nvml.nvmlDeviceGetClockInfo, handle, mem),
        mem_clock_max_mhz=_try(nvml.nvmlDeviceGetMaxClockInfo, handle, mem),
        throttle_reasons=_reasons(nvml, handle),
        persistence_mode=None if persistence is None else bool(persistence),
        mig_current=_flag(mig, 0),
        mig_pending=_flag(mig, 1),
        ecc_current=_flag(ecc, 0),
        ecc_pending=_flag(ecc, 1),
        pcie_gen=_try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_gen_max=_try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_width=_try(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_width_max=_try(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        pci_bus_id=bus_id,
        numa_node=numa,
        near_cpus=near,
    )


def import_nvml() -> Any | None:
    """The `pynvml` module from nvidia-ml-py when installed (an optional dependency), else None."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def probe_gpus(nvml: Any | None, host: HostView, root: Path = Path("/")) -> NvmlProbe:
    """Ask NVML for every GPU; a missing module or driver is a status, not an exception."""
    if nvml is None:
        return NvmlProbe("not_installed", "nvidia-ml-py (module pynvml) is not installed", None, ())
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on GPU-less hosts
        return NvmlProbe("no_driver", f"NVML could not start: {exc}", None, ())
    try:
        driver = _try(nvml.nvmlSystemGetDriverVersion)
        count = int(nvml.nvmlDeviceGetCount())
        gpus = tuple(read_gpu(nvml, i, host, root) for i in range(count))
        return NvmlProbe("ok", f"{count} GPU(s) via NVML", _text(driver) if driver else None, gpus)
    except Exception as exc:
        return NvmlProbe("error", f"NVML query failed: {exc}", None, ())
    finally:
        _try(nvml.nvmlShutdown)
