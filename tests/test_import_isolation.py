"""House rule: bench, router and plan talk HTTP or do arithmetic; importing them (any of their
modules) loads no torch and no engine or model code. Each package is imported in a fresh
interpreter, so nothing another test imported can hide a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIGHT_PACKAGES = ("tailserve.bench", "tailserve.router", "tailserve.plan")
HEAVY_PREFIXES = (
    "torch",
    "tailserve.engine",
    "tailserve.quality",
    "tailserve.executor",
    "tailserve.model",
    "tailserve.weights",
    "tailserve.kernels",
)
# The tensor-parallel split rule: owned by the runtime, read by the planner; torch-free.
LIGHT_EXCEPTIONS = ("tailserve.model", "tailserve.model.tp_split")

# Imports the package and every module under it, then prints what got loaded.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def modules_loaded_by(package: str) -> list[str]:
    """Every module in sys.modules after importing `package` and all its modules in a new interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package], capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def is_heavy(name: str) -> bool:
    if name in LIGHT_EXCEPTIONS:
        return False
    return any(name == prefix or name.startswith(prefix + ".") for prefix in HEAVY_PREFIXES)


@pytest.mark.parametrize("package", LIGHT_PACKAGES)
def test_light_package_loads_no_torch_and_no_engine(package: str) -> None:
    loaded = modules_loaded_by(package)
    assert any(name.startswith(package + ".") for name in loaded), "walked no module"
    heavy = [name for name in loaded if is_heavy(name)]
    assert heavy == [], f"importing {package} loaded {heavy[:10]}"
