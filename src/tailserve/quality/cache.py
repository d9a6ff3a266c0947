"""Where quality-gate results live: one JSON file per key under the user's cache directory.

The key (a dict) is stored inside its file and compared on read, so a file made for another model,
format or gate version is never taken for this one. Reading never raises: a bad file is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tailserve.errors import ModelLoadError
from tailserve.user_cache import user_cache_dir
from tailserve.weights.loader import default_model_path

log = logging.getLogger(__name__)

_FINGERPRINT_BYTES = 1 << 20


def default_cache_dir() -> Path:
    """$TAILSERVE_CACHE_DIR/quality, else ~/.cache/tailserve/quality (XDG_CACHE_HOME respected)."""
    return user_cache_dir("quality")


def model_files(spec: str) -> list[Path]:
    """The files whose bytes decide the weights: the .gguf, or a directory's config and safetensors."""
    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return sorted([*path.glob("*.safetensors"), *path.glob("config.json")])
    return [path]


def fingerprint(spec: str) -> str:
    """sha256 over each weight file's name, size, first and last MiB: cheap at start-up (a full
    hash of the 98 MB default model took ~10 s on a busy 2-core box); a re-download or a
    re-quantization changes the size or the header, so it changes this."""
    h = hashlib.sha256()
    for f in model_files(spec):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                fh.seek(size - _FINGERPRINT_BYTES)
                h.update(fh.read())
    return h.hexdigest()


class GateCache:
    """JSON entries `{"key": ..., ...}` in `directory`, each named by its format and key hash."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_cache_dir()

    def path(self, key: dict[str, object]) -> Path:
        """The file of `key`: its format name plus a hash of the whole key."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.directory / f"{key['weight_format']}-{digest}.json"

    def read(self, key: dict[str, object]) -> dict[str, Any] | None:
        """The entry stored for exactly `key`, else None (missing, unreadable or made for another key)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable quality-gate cache file %s: %s", path, exc)
            return None
        if not isinstance(entry, dict) or entry.get("key") != key:
            log.warning("ignoring stale quality-gate cache file %s (made for another model or gate)", path)
            return None
        return entry

    def write(self, key: dict[str, object], entry: dict[str, Any]) -> None:
        """Store `entry` atomically; a read-only cache only costs a warning (the gate runs again)."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(entry))
            tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as exc:
            log.warning("could not write the quality-gate cache %s: %s (the gate will run again)", path, exc)
