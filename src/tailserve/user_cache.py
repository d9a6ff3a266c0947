"""Where tailserve keeps what it measures or builds once per machine (gate verdicts, kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str) -> Path:
    """$TAILSERVE_CACHE_DIR/<name>, else ~/.cache/tailserve/<name> ($XDG_CACHE_HOME respected)."""
    root = os.environ.get("TAILSERVE_CACHE_DIR")
    if root:
        return Path(root).expanduser() / name
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tailserve" / name
