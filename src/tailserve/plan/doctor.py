"""`tailserve doctor`: judges what probe.py read and says what each setting costs the tail.

Read-only by construction: it only consumes HostView / GpuView snapshots and prints advice;
changing a setting is left to the operator (every finding names the command). GPU findings also name
the dcgm-exporter series that show the same thing over time (deploy/dcgm), so a one-off check and the
dashboards speak the same language.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tailserve.plan.dcgm import dcgm_watch
from tailserve.plan.probe import GpuView, HostView, NvmlProbe, import_nvml, probe_gpus, read_host

SEVERITY_ORDER = ("critical", "warn", "info", "ok")
LOW_CLOCK_RATIO = 0.5  # below half the max clock, a busy GPU is being held back
SLOWDOWN_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


@dataclass(frozen=True)
class Finding:
    """One observation: what was seen, what it costs P99, what to do about it."""

    check: str
    subject: str  # "host" or "gpu0", "gpu1", ...
    severity: str  # one of SEVERITY_ORDER
    observed: str
    tail_cost: str
    action: str
    watch: tuple[str, ...] = ()  # dcgm-exporter series that show this over time


@dataclass(frozen=True)
class DoctorReport:
    """Everything `tailserve doctor` prints."""

    host: HostView
    nvml: NvmlProbe
    findings: tuple[Finding, ...]


def _cpus(cpus: frozenset[int]) -> str:
    """A CPU set as a compact kernel-style list ("0-7,16")."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{first}-{last}" if first != last else str(first) for first, last in runs) or "none"


def check_gpu_presence(host: HostView, nvml: NvmlProbe) -> Finding:
    """Whether GPUs were found, and if not, whether that is a missing library or no hardware."""
    if nvml.gpus:
        names = ", ".join(sorted({gpu.name for gpu in nvml.gpus}))
        driver = f", driver {nvml.driver_version}" if nvml.driver_version else ""
        return Finding("gpus", "host", "ok", f"{len(nvml.gpus)} GPU(s): {names}{driver}", "none", "none")
    if nvml.status == "not_installed" and host.nvidia_driver_present:
        return Finding(
            "gpus",
            "host",
            "warn",
            "an NVIDIA driver is loaded but nvidia-ml-py is not installed, so GPUs cannot be inspected",
            "unknown: clocks, MIG, PCIe and NUMA problems go unreported",
            "pip install nvidia-ml-py (or tailserve[gpu]) and run doctor again",
        )
    return Finding(
        "gpus",
        "host",
        "info",
        f"no NVIDIA GPU found ({nvml.detail}); GPU checks skipped, host checks still run",
        "tailserve runs on CPU here: fine for dummy and small models, far from GPU TPOT",
        "none for CPU serving; for GPU serving install the driver and nvidia-ml-py",
    )


def check_clocks(gpu: GpuView) -> Finding | None:
    """SM and memory clocks against their maxima, with NVML's reason when it gives one."""
    if gpu.sm_clock_mhz is None or not gpu.sm_clock_max_mhz:
        return None
    mem = f", memory {gpu.mem_clock_mhz}/{gpu.mem_clock_max_mhz} MHz" if gpu.mem_clock_max_mhz else ""
    reasons = gpu.throttle_reasons or ()
    why = f" (reasons: {', '.join(reasons)})" if reasons else ""
    observed = f"SM clock {gpu.sm_clock_mhz}/{gpu.sm_clock_max_mhz} MHz{mem}{why}"
    slowdowns = SLOWDOWN_REASONS.intersection(reasons)
    low = gpu.sm_clock_mhz < LOW_CLOCK_RATIO * gpu.sm_clock_max_mhz or (
        gpu.mem_clock_mhz is not None
        and gpu.mem_clock_max_mhz is not None
        and gpu.mem_clock_mhz < LOW_CLOCK_RATIO * gpu.mem_clock_max_mhz
    )
    if slowdowns:
        return Finding(
            "clocks",
            f"gpu{gpu.index}",
            "warn",
            observed,
            "power or thermal capping slows every step; TPOT rises and wanders with temperature",
            "check cooling and power limits (nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE)",
        )
    if low and "gpu_idle" in reasons:
        return Finding(
            "clocks",
            f"gpu{gpu.index}",
            "info",
            observed,
            "an idle GPU downclocks; the first steps after a quiet spell run slower while clocks ramp",
            "normal when idle; to remove the ramp, lock clocks: nvidia-smi -lgc <max> (admin)",
        )
    if low:
        return Finding(
            "clocks",
            f"gpu{gpu.index}",
            "warn",
            observed,
            "decode is memory-bound and prefill compute-bound: low clocks stretch both, so TTFT and TPOT",
            "if this persists under load, look for power caps or locked clocks (nvidia-smi -q -d CLOCK); "
            "nvidia-smi -rgc resets locked clocks",
        )
    return Finding("clocks", f"gpu{gpu.index}", "ok", observed, "none", "none")


def check_persistence(gpu: GpuView) -> Finding | None:
    """Persistence mode keeps the driver initialized between processes."""
    if gpu.persistence_mode is None:
        return None
    if gpu.persistence_mode:
        return Finding("persistence_mode", f"gpu{gpu.index}", "ok", "persistence mode on", "none", "none")
    return Finding(
        "persistence_mode",
        f"gpu{gpu.index}",
        "warn",
        "persistence mode off",
        "the driver tears the GPU down when no process holds it: a (re)started server pays seconds of "
        "initialization, and clock / ECC settings can reset",
        "enable the nvidia-persistenced service (or nvidia-smi -pm 1)",
    )


def check_mig(gpu: GpuView) -> Finding | None:
    """MIG splits the card: capacity plans for the whole card do not hold for a slice."""
    if gpu.mig_current is None:
        return None
    pending = " (a different mode is pending a GPU reset)" if gpu.mig_pending != gpu.mig_current else ""
    if not gpu.mig_current:
        return Finding("mig", f"gpu{gpu.index}", "ok", f"MIG off{pending}", "none", "none")
    return Finding(
        "mig",
        f"gpu{gpu.index}",
        "warn",
        f"MIG on{pending}",
        "each MIG instance gets a fraction of the SMs, memory and bandwidth: the decode floor and KV "
        "capacity of the whole card (tailserve plan) overstate a slice several-fold",
        "plan with the slice's memory and bandwidth, or disable MIG for a dedicated serving GPU "
        f"(nvidia-smi -i {gpu.index} -mig 0, then reset)",
    )


def check_ecc(gpu: GpuView) -> Finding | None:
    """ECC state: a small capacity/bandwidth cost on GDDR cards, protection against silent errors."""
    if gpu.ecc_current is None:
        return None
    pending = " (a different mode is pending a reboot)" if gpu.ecc_pending != gpu.ecc_current else ""
    if gpu.ecc_current:
        return Finding(
            "ecc",
            f"gpu{gpu.index}",
            "info",
            f"ECC on{pending}",
            "on GDDR cards (T4, RTX) ECC reserves ~6% of memory and costs some bandwidth; free on HBM",
            "keep it on for production; count it in the KV capacity",
        )
    return Finding(
        "ecc",
        f"gpu{gpu.index}",
        "warn",
        f"ECC off{pending}",
        "an uncorrected memory error becomes wrong tokens or an Xid crash that fails every in-flight request",
        f"enable it on data-center GPUs: nvidia-smi -i {gpu.index} -e 1, then reboot",
    )


def check_pcie(gpu: GpuView) -> Finding | None:
    """PCIe link generation and width against what the card and slot support."""
    gen, gen_max, width, width_max = gpu.pcie_gen, gpu.pcie_gen_max, gpu.pcie_width, gpu.pcie_width_max
    if gen is None or gen_max is None or width is None or width_max is None:
        return None
    observed = f"PCIe gen {gen}/{gen_max}, width x{width}/x{width_max}"
    if width < width_max:
        return Finding(
            "pcie",
            f"gpu{gpu.index}",
            "warn",
            observed,
            "a narrower link cuts host<->GPU bandwidth (model load, KV swap, prompt upload, "
            "tensor-parallel traffic without NVLink)",
            "reseat the card or move it to a full-width slot; check riser cables and BIOS lane settings",
        )
    if gen < gen_max:
        return Finding(
            "pcie",
            f"gpu{gpu.index}",
            "info",
            observed,
            "idle GPUs drop the link generation to save power (harmless); if it stays low under load, "
            "transfers run at a fraction of their speed",
            "re-check under load (nvidia-smi -q -d PCIE); if still low, check BIOS PCIe generation settings",
        )
    return Finding("pcie", f"gpu{gpu.index}", "ok", observed, "none", "none")


def check_numa(gpu: GpuView, host: HostView) -> Finding | None:
    """The GPU's NUMA-local CPUs against the CPUs this process may run on."""
    if gpu.near_cpus is None or not gpu.near_cpus:
        return None
    node = f"NUMA node {gpu.numa_node}" if gpu.numa_node is not None else "its local CPUs"
    observed = (
        f"GPU on {node} (CPUs {_cpus(gpu.near_cpus)}); process affinity CPUs {_cpus(host.cpu_affinity)}"
    )
    near = gpu.near_cpus & host.cpu_affinity
    pin = (
        f"numactl --cpunodebind={gpu.numa_node} --membind={gpu.numa_node}"
        if gpu.numa_node is not None
        else ""
    )
    pin = pin or f"taskset -c {_cpus(gpu.near_cpus)}"
    if not near:
        return Finding(
            "numa",
            f"gpu{gpu.index}",
            "warn",
            observed + ": all on the far node",
            "every launch and copy crosses the socket interconnect; the scheduler loop and host->GPU "
            "transfers are slower and jitter with the other socket's load",
            f"start the server as: {pin} tailserve serve ...",
        )
    if near != host.cpu_affinity:
        return Finding(
            "numa",
            f"gpu{gpu.index}",
            "info",
            observed + ": spans near and far CPUs",
            "the OS may move the server thread to the far node now and then: occasional slow steps",
            f"pin it: {pin} tailserve serve ...",
        )
    return Finding("numa", f"gpu{gpu.index}", "ok", observed, "none", "none")


def check_mps(host: HostView) -> Finding:
    """An MPS daemon lets other processes' kernels share the GPU's SMs with ours."""
    if not host.mps_running:
        return Finding("mps", "host", "ok", "no MPS daemon running", "none", "none")
    return Finding(
        "mps",
        "host",
        "warn",
        "an MPS control daemon / server is running",
        "other clients' kernels run concurrently on the same SMs: decode steps stretch unpredictably (TPOT jitter)",
        "serve from a GPU without MPS clients, or quit it (echo quit | nvidia-cuda-mps-control) if unused",
    )


def check_launch_blocking(host: HostView) -> Finding:
    """CUDA_LAUNCH_BLOCKING makes every kernel launch synchronous."""
    value = host.environ.get("CUDA_LAUNCH_BLOCKING")
    if value in (None, "", "0"):
        return Finding("cuda_launch_blocking", "host", "ok", "CUDA_LAUNCH_BLOCKING not set", "none", "none")
    return Finding(
        "cuda_launch_blocking",
        "host",
        "critical",
        f"CUDA_LAUNCH_BLOCKING={value}",
        "every kernel launch waits for the GPU: CPU and GPU never overlap, decode steps take several times longer",
        "unset CUDA_LAUNCH_BLOCKING (it is a debugging switch)",
    )


def check_governor(host: HostView) -> Finding:
    """The cpufreq governor of the CPUs this process may use."""
    ours = {cpu: gov for cpu, gov in host.governors.items() if cpu in host.cpu_affinity}
    if not ours:
        return Finding(
            "cpu_governor",
            "host",
            "info",
            "cpufreq governor not exposed (VM or container)",
            "unknown: a power-saving governor on the real host slows the CPU-side scheduler after idle gaps",
            "check on the host: cat /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor",
        )
    slow = sorted({gov for gov in ours.values() if gov != "performance"})
    observed = "governor " + ", ".join(sorted(set(ours.values()))) + f" on CPUs {_cpus(frozenset(ours))}"
    if not slow:
        return Finding("cpu_governor", "host", "ok", observed, "none", "none")
    return Finding(
        "cpu_governor",
        "host",
        "warn",
        observed,
        "a dynamic governor lowers the clock between bursts: scheduling, tokenization and kernel launches "
        "run slower at the start of each burst, which lands in TTFT and ITL",
        "cpupower frequency-set -g performance (or tuned-adm profile latency-performance)",
    )


def diagnose(host: HostView, nvml: NvmlProbe) -> DoctorReport:
    """All findings for a host snapshot and its GPUs, most severe first."""
    findings: list[Finding] = [check_gpu_presence(host, nvml)]
    for gpu in nvml.gpus:
        gpu_checks = (
            check_clocks(gpu),
            check_persistence(gpu),
            check_mig(gpu),
            check_ecc(gpu),
            check_pcie(gpu),
            check_numa(gpu, host),
        )
        findings.extend(replace(f, watch=dcgm_watch(f.check, gpu)) for f in gpu_checks if f is not None)
    findings += [check_mps(host), check_launch_blocking(host), check_governor(host)]
    findings.sort(key=lambda f: SEVERITY_ORDER.index(f.severity))
    return DoctorReport(host, nvml, tuple(findings))


def run_doctor(nvml_module: Any | None = None, root: Path = Path("/")) -> DoctorReport:
    """Probe this host (through `nvml_module`, else pynvml if installed) and diagnose it."""
    host = read_host(root)
    nvml = nvml_module if nvml_module is not None else import_nvml()
    return diagnose(host, probe_gpus(nvml, host, root))


def _gpu_line(gpu: GpuView) -> str:
    """A one-line GPU summary."""
    memory = f"{gpu.memory_total_bytes / 2**30:.0f} GiB" if gpu.memory_total_bytes else "? GiB"
    return f"  gpu{gpu.index}: {gpu.name}, {memory}, bus {gpu.pci_bus_id or '?'}, NUMA node {gpu.numa_node}"


def render_text(report: DoctorReport) -> str:
    """The human report: GPUs, host, then findings most severe first."""
    host = report.host
    lines = ["tailserve doctor (read-only: changes no setting)", f"NVML: {report.nvml.detail}"]
    lines += [_gpu_line(gpu) for gpu in report.nvml.gpus]
    nodes = ", ".join(f"node{n}: {_cpus(c)}" for n, c in sorted(host.numa_cpus.items())) or "unknown"
    lines.append(f"host: CPU affinity {_cpus(host.cpu_affinity)}; NUMA {nodes}")
    lines.append("")
    for f in report.findings:
        lines.append(f"[{f.severity.upper():>8}] {f.subject:<5} {f.check}: {f.observed}")
        if f.severity != "ok":
            lines.append(f"{'':17}tail cost: {f.tail_cost}")
            lines.append(f"{'':17}do: {f.action}")
            if f.watch:
                lines.append(f"{'':17}watch (dcgm-exporter): {', '.join(f.watch)}")
    return "\n".join(lines)


def to_json_dict(report: DoctorReport) -> dict[str, Any]:
    """The machine-readable report (`tailserve doctor --json`)."""
    host = report.host
    gpus = [
        {**asdict(gpu), "near_cpus": sorted(gpu.near_cpus) if gpu.near_cpus is not None else None}
        for gpu in report.nvml.gpus
    ]
    return {
        "nvml": {
            "status": report.nvml.status,
            "detail": report.nvml.detail,
            "driver": report.nvml.driver_version,
        },
        "gpus": gpus,
        "host": {
            "cpu_affinity": sorted(host.cpu_affinity),
            "numa_cpus": {str(n): sorted(c) for n, c in host.numa_cpus.items()},
            "governors": {str(c): g for c, g in sorted(host.governors.items())},
            "environ": dict(host.environ),
            "mps_running": host.mps_running,
            "nvidia_driver_present": host.nvidia_driver_present,
        },
        "findings": [asdict(f) for f in report.findings],
    }
