"""`tailserve doctor`: the NVML path through a recorded fake of a misconfigured host, the sysfs
readers through a fake /sys and /proc tree, and the real GPU-less path of this machine.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest

from tailserve.plan.dcgm import CLOCK_EVENT_LABELS
from tailserve.plan.doctor import diagnose, render_text, run_doctor, to_json_dict
from tailserve.plan.probe import THROTTLE_REASONS, HostView, parse_cpulist, probe_gpus, read_host


class NVMLError(Exception):
    """What pynvml raises for unsupported queries."""


class FakeNvml:
    """A pynvml stand-in recorded from a misconfigured two-socket host.

    GPU 0: SM clock at 30% of max under a power cap, persistence off, MIG on, ECC off (on pending),
    PCIe gen 3 x8 in a gen 5 x16 slot, on NUMA node 1 while the process runs on node 0.
    GPU 1: healthy, but answers "not supported" to the optional queries.
    """

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"  # old pynvml releases return bytes

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=80 << 30, used=0, free=80 << 30)

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:
        return {(0, 1): 600, (0, 2): 2619, (1, 1): 1980, (1, 2): 2619}[(handle, clock)]

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> int:
        return {1: 1980, 2: 2619}[clock]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return 0x4 if handle == 0 else 0  # SW power cap

    def nvmlDeviceGetPersistenceMode(self, handle: int) -> int:
        return 0 if handle == 0 else 1

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        if handle == 1:
            raise NVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetEccMode(self, handle: int) -> list[int]:
        if handle == 1:
            raise NVMLError("Not Supported")
        return [0, 1]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return 3 if handle == 0 else 5

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return 8 if handle == 0 else 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return 16

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:{0x3B + handle:02X}:00.0")

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
        return 1 if handle == 0 else 0

    def nvmlDeviceGetCpuAffinity(self, handle: int, words: int) -> list[int]:
        raise NVMLError("Not Supported")


def misconfigured_host() -> HostView:
    """Process pinned to node 0, MPS running, launch blocking on, powersave governor."""
    return HostView(
        cpu_affinity=frozenset(range(8)),
        numa_cpus=MappingProxyType({0: frozenset(range(8)), 1: frozenset(range(8, 16))}),
        governors=MappingProxyType(dict.fromkeys(range(16), "powersave")),
        environ=MappingProxyType({"CUDA_LAUNCH_BLOCKING": "1"}),
        mps_running=True,
        nvidia_driver_present=True,
    )


def test_every_misconfiguration_is_reported_with_cost_and_action() -> None:
    host = misconfigured_host()
    report = diagnose(host, probe_gpus(FakeNvml(), host, Path("/nonexistent")))
    gpu0 = {f.check: f for f in report.findings if f.subject == "gpu0"}
    hostwide = {f.check: f for f in report.findings if f.subject == "host"}

    assert gpu0["clocks"].severity == "warn" and "600/1980 MHz" in gpu0["clocks"].observed
    assert "sw_power_cap" in gpu0["clocks"].observed
    assert gpu0["persistence_mode"].severity == "warn"
    assert gpu0["mig"].severity == "warn" and "MIG on" in gpu0["mig"].observed
    assert gpu0["ecc"].severity == "warn" and "pending" in gpu0["ecc"].observed
    assert gpu0["pcie"].severity == "warn" and "gen 3/5, width x8/x16" in gpu0["pcie"].observed
    assert gpu0["numa"].severity == "warn" and "far node" in gpu0["numa"].observed
    assert "numactl --cpunodebind=1 --membind=1" in gpu0["numa"].action
    assert hostwide["mps"].severity == "warn"
    assert hostwide["cuda_launch_blocking"].severity == "critical"
    assert hostwide["cpu_governor"].severity == "warn" and "powersave" in hostwide["cpu_governor"].observed
    assert hostwide["gpus"].severity == "ok" and "driver 550.54.15" in hostwide["gpus"].observed
    for finding in report.findings:
        if finding.severity != "ok":
            assert finding.tail_cost and finding.action and finding.action != "none", finding
    assert report.findings[0].severity == "critical"  # most severe first


def test_gpu_findings_name_the_dcgm_series_that_watch_them() -> None:
    host = misconfigured_host()
    report = diagnose(host, probe_gpus(FakeNvml(), host, Path("/nonexistent")))
    gpu0 = {f.check: f for f in report.findings if f.subject == "gpu0"}
    # NVML said sw_power_cap; the exporter's per-reason series calls it power_cap.
    assert 'DCGM_EXP_CLOCK_EVENTS_COUNT{clock_event=~"power_cap"}' in gpu0["clocks"].watch
    assert "DCGM_FI_DEV_SM_CLOCK" in gpu0["clocks"].watch
    assert gpu0["ecc"].watch[0] == "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
    assert "DCGM_FI_PROF_PCIE_TX_BYTES" in gpu0["pcie"].watch
    assert gpu0["numa"].watch == ()
    healthy = next(f for f in report.findings if f.subject == "gpu1" and f.check == "clocks")
    assert "DCGM_EXP_CLOCK_EVENTS_COUNT" in healthy.watch  # no reason: the whole series
    text = render_text(report)
    assert "watch (dcgm-exporter): DCGM_FI_DEV_SM_CLOCK, DCGM_FI_DEV_MAX_SM_CLOCK" in text
    assert next(f for f in to_json_dict(report)["findings"] if f["check"] == "ecc")["watch"]
    assert set(CLOCK_EVENT_LABELS) == set(THROTTLE_REASONS.values())


def test_healthy_gpu_is_ok_and_unsupported_queries_are_skipped() -> None:
    host = misconfigured_host()
    report = diagnose(host, probe_gpus(FakeNvml(), host, Path("/nonexistent")))
    gpu1 = {f.check: f.severity for f in report.findings if f.subject == "gpu1"}
    assert gpu1 == {"clocks": "ok", "persistence_mode": "ok", "pcie": "ok", "numa": "ok"}  # no mig / ecc


def test_doctor_only_reads_from_nvml() -> None:
    nvml, host = FakeNvml(), misconfigured_host()
    probe_gpus(nvml, host, Path("/nonexistent"))
    setters = [
        c
        for c in nvml.calls
        if not c.startswith(("nvmlDeviceGet", "nvmlSystemGet", "nvmlInit", "nvmlShutdown"))
    ]
    assert setters == []
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"


def test_text_and_json_reports_carry_every_finding() -> None:
    host = misconfigured_host()
    report = diagnose(host, probe_gpus(FakeNvml(), host, Path("/nonexistent")))
    text = render_text(report)
    assert "[CRITICAL] host  cuda_launch_blocking" in text and "gpu0: NVIDIA H100 80GB HBM3, 80 GiB" in text
    doc = to_json_dict(report)
    assert len(doc["findings"]) == len(report.findings)
    assert doc["gpus"][0]["near_cpus"] == list(range(8, 16))


def test_nvml_that_cannot_start_means_no_gpus() -> None:
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError("Driver Not Loaded")

    host = misconfigured_host()
    probe = probe_gpus(NoDriver(), host)
    assert (probe.status, probe.gpus) == ("no_driver", ())
    gpus = next(f for f in diagnose(host, probe).findings if f.check == "gpus")
    assert "no NVIDIA GPU found" in gpus.observed


def test_driver_without_nvidia_ml_py_says_what_to_install() -> None:
    host = misconfigured_host()
    gpus = next(f for f in diagnose(host, probe_gpus(None, host)).findings if f.check == "gpus")
    assert gpus.severity == "warn" and "nvidia-ml-py" in gpus.action


def test_host_reader_on_a_fake_sys_and_proc_tree(tmp_path: Path) -> None:
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (tmp_path / f"sys/devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        (tmp_path / f"sys/devices/system/cpu/cpu{cpu}/cpufreq").mkdir(parents=True)
        (tmp_path / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor").write_text("schedutil\n")
    (tmp_path / "proc/4242").mkdir(parents=True)
    (tmp_path / "proc/4242/comm").write_text("nvidia-cuda-mps\n")
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0/numa_node").write_text("1\n")

    host = read_host(
        tmp_path, environ={"CUDA_LAUNCH_BLOCKING": "0", "HOME": "/root"}, cpu_affinity=frozenset({0, 1})
    )
    assert host.numa_cpus == {0: frozenset(range(4)), 1: frozenset(range(4, 8))}
    assert set(host.governors.values()) == {"schedutil"}
    assert host.mps_running and not host.nvidia_driver_present
    assert dict(host.environ) == {"CUDA_LAUNCH_BLOCKING": "0"}

    class NoNumaQuery(FakeNvml):  # older drivers: the NUMA node comes from sysfs instead
        def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
            raise NVMLError("Function Not Found")

    report = diagnose(host, probe_gpus(NoNumaQuery(), host, tmp_path))
    numa = next(f for f in report.findings if f.subject == "gpu0" and f.check == "numa")
    assert "NUMA node 1 (CPUs 4-7)" in numa.observed and numa.severity == "warn"
    governor = next(f for f in report.findings if f.check == "cpu_governor")
    assert governor.severity == "warn" and "CPUs 0-1" in governor.observed


@pytest.mark.parametrize(("text", "cpus"), [("0-3,8-9", {0, 1, 2, 3, 8, 9}), ("5", {5}), ("", set())])
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.skipif(
    Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia").exists(),
    reason="this host has an NVIDIA GPU",
)
def test_doctor_on_this_gpu_less_machine() -> None:
    report = run_doctor()
    assert report.nvml.gpus == ()
    gpus = next(f for f in report.findings if f.check == "gpus")
    assert "no NVIDIA GPU found" in gpus.observed
    assert {f.check for f in report.findings} >= {"mps", "cuda_launch_blocking", "cpu_governor"}
