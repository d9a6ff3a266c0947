"""The results folder of a comparison, written as it goes so a rerun resumes where it stopped:
one JSON per (server, workload, point) written atomically when that point completes, the frozen
SLO per workload, and a progress log (`progress.log`) to follow a run in the background.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any


class Store:
    """`DIR/<server>/<workload>/<point>.json`, `DIR/slo-<workload>.json`, `DIR/progress.log`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts[:-1], parts[-1] + ".json")

    def folder(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    def has(self, *parts: str) -> bool:
        return self.path(*parts).exists()

    def load(self, *parts: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.path(*parts).read_text())
        except (OSError, ValueError):
            return None
        return data

    def save(self, doc: dict[str, Any], *parts: str) -> Path:
        """Write through a temporary file and rename, so a killed run never leaves half a point."""
        path = self.path(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
        return path

    def points(self, server: str, workload: str, prefix: str) -> list[dict[str, Any]]:
        """The saved points of one server and workload whose names start with `prefix`, in name order
        (probe-01, probe-02, ...)."""
        folder = self.folder(server, workload)
        names = sorted(p.stem for p in folder.glob(f"{prefix}*.json")) if folder.exists() else []
        return [d for d in (self.load(server, workload, n) for n in names) if d is not None]

    def log(self, message: str) -> None:
        """One timestamped line to stderr and to progress.log (`tail -f` it)."""
        line = f"[{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        print(line, file=sys.stderr, flush=True)
        with (self.root / "progress.log").open("a") as f:
            f.write(line + "\n")
