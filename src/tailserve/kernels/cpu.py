"""The fused CPU kernels (cpu_kernels.c): built once per machine with the system C compiler, loaded by ctypes.

A decoder layer's small ops (norms, RoPE, the KV write, SiLU, residual adds) cost more than its
matmuls at decode batch sizes when each is a torch op. These kernels do each group in one call on raw
pointers, and decode attention reads the paged cache in place. The shared object is cached under
$TAILSERVE_CACHE_DIR/kernels (default ~/.cache/tailserve/kernels), named by a hash of the source,
the compiler and its flags, so an edit or another CPU builds afresh. Without a compiler, `load()`
returns None and the model runs the torch path (same results within bf16 rounding).
TAILSERVE_CPU_ISA picks a lower instruction set than the CPU's best (docs/ENGINE.md, "Which kernel
each CPU gets"), so every path this machine can execute is tested on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from tailserve.errors import ConfigError
from tailserve.user_cache import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ABI_VERSION = 7
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-shared", "-fPIC", "-std=c11"]
# Threads through OpenMP, bound at load to the libgomp torch already loaded (one team for both);
# where the compiler has no OpenMP the kernels build without it and run on the caller's thread.
OPENMP = "-fopenmp"
DISABLE_ENV = "TAILSERVE_CPU_KERNELS"  # "0" turns the kernels off (the torch path runs)
ISA_ENV = "TAILSERVE_CPU_ISA"  # native (default) | amx | avx512bf16 | avx512 | portable
# What each ISA adds to -march=native on x86-64: AMX off for avx512bf16, AMX and AVX512-BF16 off
# for avx512 (what a Xeon whose VM hides them, or an Ice Lake, runs), all of AVX-512 (and so
# AMX, whose kernels need AVX512-BF16) off for portable. Elsewhere only native and portable exist,
# and both are the plain -march=native build.
ISA_FLAGS: dict[str, list[str]] = {
    "native": [],
    "amx": [],
    "avx512bf16": ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "avx512": ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "portable": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
}
ISA_CPU_FLAGS = {
    "amx": ("amx_tile", "amx_bf16", "avx512_bf16"),
    "avx512bf16": ("avx512_bf16",),
    "avx512": ("avx512f", "avx512dq"),
}
ISA_TILE = {"amx": 2, "avx512bf16": 1, "avx512": 0, "portable": 0}  # what ts_tile_isa must say under each

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "ts_rms_norm": [_P, _P, _P, _I, _I, _F],
    "ts_add_rms_norm": [_P, _P, _I, _P, _P, _I, _I, _F],
    "ts_silu_mul": [_P, _P, _I, _I],
    "ts_rope_write_kv": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "ts_paged_decode_attention": [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F],
    "ts_paged_prompt_attention": [_P, _I, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _F],
    "ts_q8_matmul": [_P, _I, _I, _P, _P, _I, _P],
    "ts_q4_matmul": [_P, _I, _I, _P, _P, _P, _P, _I, _P],
    "ts_q4_prefill_matmul": [_P, _I, _I, _P, _P, _P, _P, _I, _P],
    "ts_q4_prefill_silu_matmul": [_P, _I, _I, _P, _P, _P, _P, _I, _P],
    "ts_pack_q4": [_P, _I, _I, _P],
    "ts_q4a8_prefill_matmul": [_P, _I, _I, _P, _P, _P, _P, _I, _P],
    "ts_q8a8_matmul": [_P, _I, _I, _P, _P, _P, _I, _P],
    "ts_q4a16_matmul": [_P, _I, _I, _P, _P, _P, _P, _I, _P],
    "ts_apply_token_bitmask": [_P, _I, _P, _I, _P, _I, _I],
    "ts_decode_layers": [_P, _I, *[_P] * 7, *[_I] * 6, *[_P] * 5, _I, _P, _I, _F, _F, ctypes.c_int],
}


class DecodeLayer(ctypes.Structure):
    """One decoder layer's raw pointers for ts_decode_layers: per int4 matmul (qkv, o, gate|up,
    down) its packed groups, scale, shifted min and bias (0: none), the two norm weights and the
    layer's K and V caches."""

    _fields_ = [
        ("packed", _P * 4),
        ("scale", _P * 4),
        ("shifted_min", _P * 4),
        ("bias", _P * 4),
        ("input_norm", _P),
        ("post_norm", _P),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


def kernel_dir() -> Path:
    return user_cache_dir("kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def selected_isa() -> str:
    """The instruction set the kernels are built for: TAILSERVE_CPU_ISA, checked against this CPU.
    A set the CPU lacks is a ConfigError naming what it has, never a silent step down."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ConfigError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    if isa in ("amx", "avx512bf16") and platform.machine() not in ("x86_64", "AMD64"):
        raise ConfigError(f"{ISA_ENV}={isa} is an x86-64 instruction set; this is {platform.machine()}")
    flags = set(_cpu_flags().split())
    missing = [f for f in ISA_CPU_FLAGS.get(isa, ()) if f not in flags]
    if missing:
        can = ", ".join(i for i in ISA_FLAGS if all(f in flags for f in ISA_CPU_FLAGS.get(i, ())))
        raise ConfigError(
            f"{ISA_ENV}={isa} needs CPU flags {', '.join(missing)}, which this CPU lacks; it can run: {can}"
        )
    return isa


def _isa_flags(isa: str) -> list[str]:
    return ISA_FLAGS[isa] if platform.machine() in ("x86_64", "AMD64") else []


def _build(cc: str, target: Path, isa: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        for flags in ([*FLAGS, *_isa_flags(isa), OPENMP], [*FLAGS, *_isa_flags(isa)]):
            cmd = [cc, *flags, str(SOURCE), "-o", str(out), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                break
            if OPENMP in flags:
                log.info("fused CPU kernels: no OpenMP with %s, building them single-threaded", cc)
        else:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent builder never loads half a file


def _target(cc: str, isa: str) -> Path:
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update("\0".join([cc, *FLAGS, *_isa_flags(isa), OPENMP, platform.machine(), _cpu_flags()]).encode())
    return kernel_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def identity() -> str:
    """Which kernels run here, for cache keys of measurements (the quality gate): the build's hash
    and the tile product its int matmuls run on (AMX or AVX512-BF16), or "off"."""
    lib = load()
    if lib is None:
        return "off"
    return f"{Path(lib._name).stem}{TILE_ISA_SUFFIX[tile_isa()]}"


@cache
def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None where they cannot be (no compiler, not x86/arm, disabled)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    isa = selected_isa()
    cc = _compiler()
    if cc is None or platform.system() != "Linux":
        log.info("fused CPU kernels unavailable (no C compiler on Linux); the torch path runs")
        return None
    target = _target(cc, isa)
    try:
        if not target.exists():
            _build(cc, target, isa)
            log.info("built fused CPU kernels: %s", target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("fused CPU kernels unavailable (%s); the torch path runs", exc)
        return None
    if lib.ts_abi_version() != ABI_VERSION:
        log.warning("fused CPU kernels at %s have another ABI; the torch path runs", target)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = None
    lib.ts_amx_init.restype = ctypes.c_int
    lib.ts_paged_prompt_attention.restype = ctypes.c_int  # 1: ran (AMX); 0: nothing written
    lib.ts_tile_isa.restype = ctypes.c_int
    lib.ts_vnni.restype = ctypes.c_int
    lib.ts_prompt_scores.restype = ctypes.c_int  # 0 none, 1 AMX, 2 float32 FMAs, 3 int8 dot products
    lib.ts_q4a8_prefill_matmul.restype = ctypes.c_int  # 1: ran (VNNI or AVX2); 0: nothing written
    lib.ts_q8a8_matmul.restype = ctypes.c_int  # the same
    lib.ts_q4a16_matmul.restype = ctypes.c_int  # the same
    lib.ts_set_threads.argtypes = [ctypes.c_int]
    lib.ts_set_threads.restype = ctypes.c_int
    lib.ts_threads.restype = ctypes.c_int
    want = ISA_TILE.get(isa)
    if want is not None and lib.ts_tile_isa() != want:  # e.g. the OS refused AMX tile data
        raise ConfigError(
            f"{ISA_ENV}={isa}: the kernels built for it run on tile ISA {lib.ts_tile_isa()} here, not {want}"
        )
    return lib


def sync_threads() -> int:
    """Give the kernels called from this thread torch's intra-op thread count of this thread
    (`--num-threads`; both are per thread), so one knob sets both; a no-op once they agree. Returns
    the kernels' count (1 without the kernels)."""
    lib = load()
    if lib is None:
        return 1
    want = torch.get_num_threads()
    have = int(lib.ts_threads())
    return have if have == want else int(lib.ts_set_threads(want))


TILE_ISA_SUFFIX = ("", "+avx512bf16", "+amx")  # by ts_tile_isa: none, AVX512-BF16, AMX


@cache
def tile_isa() -> int:
    """What the int matmuls (ts_q4_matmul, ts_q8_matmul) run on here: 2 AMX (built with it, and the
    OS granted tile data), 1 AVX512-BF16 dot products (e.g. AMD Zen 4), 0 neither (they cannot run)."""
    lib = load()
    return 0 if lib is None else int(lib.ts_tile_isa())


def amx() -> ctypes.CDLL | None:
    """The kernels if their AMX matmuls can run here: what prompt rows on int4 (ts_q4_prefill_matmul)
    need; the decode and head int matmuls need only `tile_matmuls`."""
    return load() if tile_isa() == 2 else None


def tile_matmuls() -> ctypes.CDLL | None:
    """The kernels if their int4 layer and Q8_0 head matmuls run here (on AMX or AVX512-BF16)."""
    return load() if tile_isa() > 0 else None


def vnni() -> ctypes.CDLL | None:
    """The kernels if their int8 dot-product prompt rows (ts_q4a8_prefill_matmul) run here: built
    with AVX512-VNNI (not in the portable build)."""
    lib = load()
    return lib if lib is not None and lib.ts_vnni() == 1 else None


def int8_dots() -> ctypes.CDLL | None:
    """The kernels if their int8 dot-product matmuls (ts_q4a16_matmul, ts_q8a8_matmul,
    ts_q4a8_prefill_matmul) run here at all: with AVX512-VNNI (`vnni`) or, about half as fast a
    cycle, on AVX2 (the portable build too). The same bits either way."""
    lib = load()
    return lib if lib is not None and lib.ts_vnni() in (1, 2) else None


# Flags of CPUs that compute bf16 themselves (x86 AVX512-BF16 or AMX, Arm's BF16 extension).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic; without it (an Ice Lake Xeon, an AVX2 desktop, or a VM
    that hides the flags) torch's bf16 GEMMs are emulated, ~4.5x slower than float32. True where the
    flags cannot be read (nothing is changed on a guess)."""
    flags = _cpu_flags().split()
    return not flags or any(f in flags for f in _BF16_FLAGS)


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native depends on them); empty where /proc is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())
