"""The dcgm-exporter series that watch what `tailserve doctor` checks once (deploy/dcgm), so a one-off
check and the dashboards speak the same language.

Names only: it reads no device and judges nothing (doctor.py does).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tailserve.plan.probe import GpuView

# The dcgm-exporter fields (deploy/dcgm/counters.csv turns them on) that watch each GPU check.
DCGM_WATCH: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "clocks": (
            "DCGM_FI_DEV_SM_CLOCK",
            "DCGM_FI_DEV_MAX_SM_CLOCK",
            "DCGM_FI_DEV_MEM_CLOCK",
            "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
            "DCGM_EXP_CLOCK_EVENTS_COUNT",
            "DCGM_FI_DEV_GPU_TEMP",
        ),
        "ecc": ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
        "pcie": (
            "DCGM_FI_PROF_PCIE_TX_BYTES",
            "DCGM_FI_PROF_PCIE_RX_BYTES",
            "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        ),
        "mig": ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_DEV_FB_USED"),
    }
)
# NVML's reason names (probe.THROTTLE_REASONS) as the exporter's clock_event label spells them.
CLOCK_EVENT_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "gpu_idle": "gpu_idle",
        "applications_clocks_setting": "clocks_setting",
        "sw_power_cap": "power_cap",
        "hw_slowdown": "hw_slowdown",
        "sync_boost": "sync_boost",
        "sw_thermal_slowdown": "sw_thermal",
        "hw_thermal_slowdown": "hw_thermal",
        "hw_power_brake_slowdown": "hw_power_brake",
        "display_clock_setting": "display_clocks",
    }
)


def dcgm_watch(check: str, gpu: GpuView) -> tuple[str, ...]:
    """The dcgm-exporter series for a GPU check; the clock events narrowed to the reasons NVML gave."""
    fields = DCGM_WATCH.get(check, ())
    events = [CLOCK_EVENT_LABELS[r] for r in gpu.throttle_reasons or () if r in CLOCK_EVENT_LABELS]
    if check != "clocks" or not events:
        return fields
    selector = f'{{clock_event=~"{"|".join(events)}"}}'
    return tuple(f + selector if f == "DCGM_EXP_CLOCK_EVENTS_COUNT" else f for f in fields)
