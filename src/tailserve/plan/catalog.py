"""The GPU catalog: memory, bandwidth and dense tensor throughput of the cards the planner knows.

Built-in entries come from vendor spec sheets (dense, i.e. without 2:4 sparsity); a user file
(JSON or TOML) can add cards or override them. Looking a card up never mutates the catalog.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tailserve.plan.errors import PlanError

GIB = 1 << 30
COMPUTE_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model as a spec sheet describes it."""

    name: str
    memory_gib: float
    bandwidth_gb_s: float
    # Dense tensor-core TFLOPS (TOPS for int) by dtype; a dtype absent here has no tensor-core path.
    dense_tflops: Mapping[str, float] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A read-only view, so the built-in catalog cannot be edited by whoever looks a card up.
        object.__setattr__(self, "dense_tflops", MappingProxyType(dict(self.dense_tflops)))
        if self.memory_gib <= 0 or self.bandwidth_gb_s <= 0:
            raise PlanError(f"GPU {self.name!r}: memory_gib and bandwidth_gb_s must be positive")
        for dtype, tflops in self.dense_tflops.items():
            if dtype not in COMPUTE_DTYPES or tflops <= 0:
                raise PlanError(f"GPU {self.name!r}: bad dense_tflops entry {dtype}={tflops}")

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (cards are sold in binary gigabytes)."""
        return int(self.memory_gib * GIB)

    @property
    def bandwidth_bytes_s(self) -> float:
        """Peak memory bandwidth in bytes per second (spec sheets quote decimal GB/s)."""
        return self.bandwidth_gb_s * 1e9


BUILTIN_GPUS: tuple[GpuSpec, ...] = (
    # Turing: FP16 tensor cores (65 TFLOPS mixed precision), INT8 130 / INT4 260 TOPS, no bf16, no fp8.
    GpuSpec("T4", 16, 320, {"fp16": 65, "int8": 130, "int4": 260}, ("t4-16gb", "tesla-t4")),
    # GA102 whitepaper: 71 TFLOPS fp16/bf16 with fp32 accumulate (what frameworks use), INT8 284.
    GpuSpec("RTX 3090", 24, 936, {"bf16": 71, "fp16": 71, "int8": 284, "int4": 568}, ("3090",)),
    # Volta: fp16 tensor cores only (130 TFLOPS on V100S PCIe).
    GpuSpec("V100S", 32, 1134, {"fp16": 130}, ("v100s-32gb", "v100s-pcie")),
    GpuSpec("A100 40GB", 40, 1555, {"bf16": 312, "fp16": 312, "int8": 624, "int4": 1248}, ("a100-40",)),
    GpuSpec(
        "A100 80GB", 80, 2039, {"bf16": 312, "fp16": 312, "int8": 624, "int4": 1248}, ("a100", "a100-80")
    ),
    # Hopper: 989 TFLOPS bf16/fp16, 1979 fp8 / int8 TOPS dense (the 1979/3958 headline is sparse).
    GpuSpec(
        "H100 SXM 80GB", 80, 3350, {"bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, ("h100", "h100-sxm")
    ),
    GpuSpec("H200 141GB", 141, 4800, {"bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, ("h200",)),
)


def _key(name: str) -> str:
    """Lookup key: case, spaces, dashes and underscores do not matter ("h100-sxm" == "H100 SXM")."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


@dataclass(frozen=True)
class GpuCatalog:
    """An immutable set of GPU specs, looked up by name or alias."""

    gpus: tuple[GpuSpec, ...] = BUILTIN_GPUS

    def names(self) -> list[str]:
        """Catalog names in catalog order."""
        return [gpu.name for gpu in self.gpus]

    def get(self, name: str) -> GpuSpec:
        """The spec called `name`; PlanError listing the known names otherwise."""
        wanted = _key(name)
        for gpu in reversed(self.gpus):  # later entries (user files) win
            if wanted in {_key(gpu.name), *(_key(a) for a in gpu.aliases)}:
                return gpu
        raise PlanError(
            f"unknown GPU {name!r}; known: {', '.join(self.names())} (add others with --gpu-catalog FILE)"
        )

    def extended(self, extra: Iterable[GpuSpec]) -> GpuCatalog:
        """A new catalog with `extra` added; an entry with a known name replaces the old one."""
        extra = tuple(extra)
        replaced = {_key(gpu.name) for gpu in extra}
        kept = tuple(gpu for gpu in self.gpus if _key(gpu.name) not in replaced)
        return GpuCatalog(kept + extra)


def _spec_from_mapping(entry: Any, source: Path) -> GpuSpec:
    """One user catalog entry -> GpuSpec, with the file named in every error."""
    if not isinstance(entry, Mapping):
        raise PlanError(f"{source}: each GPU entry must be a table/object, got {type(entry).__name__}")
    try:
        name = str(entry["name"])
        memory_gib = float(entry["memory_gib"])
        bandwidth = float(entry["bandwidth_gb_s"])
    except KeyError as exc:
        raise PlanError(f"{source}: GPU entry {dict(entry)!r} lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{source}: GPU entry {entry.get('name')!r}: {exc}") from None
    tflops = entry.get("dense_tflops", {})
    aliases = entry.get("aliases", [])
    if not isinstance(tflops, Mapping) or not isinstance(aliases, list):
        raise PlanError(f"{source}: GPU {name!r}: dense_tflops must be a table, aliases a list")
    try:
        tflops_f = {str(k): float(v) for k, v in tflops.items()}
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{source}: GPU {name!r}: dense_tflops: {exc}") from None
    return GpuSpec(name, memory_gib, bandwidth, tflops_f, tuple(str(a) for a in aliases))


def load_catalog_file(path: Path) -> list[GpuSpec]:
    """GPU specs from a JSON or TOML file: a list, or a table with a `gpu` / `gpus` list."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot read GPU catalog {path}: {exc.strerror}") from None
    try:
        data: Any = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(
            f"GPU catalog {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}"
        ) from None
    entries = data.get("gpu", data.get("gpus")) if isinstance(data, Mapping) else data
    if not isinstance(entries, list):
        raise PlanError(f"GPU catalog {path}: expected a list of GPUs (or a `gpu` / `gpus` list)")
    return [_spec_from_mapping(entry, path) for entry in entries]


def build_catalog(extra_file: Path | None = None) -> GpuCatalog:
    """The built-in catalog, extended by `extra_file` when given."""
    catalog = GpuCatalog()
    return catalog if extra_file is None else catalog.extended(load_catalog_file(extra_file))
