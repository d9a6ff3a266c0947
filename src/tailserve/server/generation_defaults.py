"""The model's own sampling defaults (vLLM's `--generation-config auto`), for requests that omit them.

Read once at startup from a Hugging Face `generation_config.json` or a GGUF file's
`general.sampling.*` metadata; a missing file or key leaves that default to the OpenAI one. Never
loads weights and never imports torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("tailserve.server")

# Each field's key: generation_config.json names them as we do; GGUF metadata under general.sampling.
_HF_KEYS = {name: name for name in ("temperature", "top_p", "top_k")}
_GGUF_KEYS = {
    name: f"general.sampling.{key}"
    for name, key in (("temperature", "temp"), ("top_p", "top_p"), ("top_k", "top_k"))
}


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling values used when a request leaves them out; None means the OpenAI default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def describe(self) -> str:
        """For the startup log: `temperature=0.2 top_p=0.9`, or `none`."""
        parts = [f"{k}={v}" for k, v in vars(self).items() if v is not None]
        return " ".join(parts) or "none"


def model_file(spec: str) -> Path | None:
    """The file or directory a --model spec names (None for dummy weights)."""
    if spec.startswith("dummy:"):
        return None
    if spec == "default":
        from tailserve.weights.loader import default_model_path  # serve has loaded torch by now

        return default_model_path()
    return Path(spec).expanduser()


def read_generation_defaults(model_path: Path | None) -> GenerationDefaults:
    """Defaults from an HF model directory or a .gguf file; empty for anything else or on a bad file."""
    if model_path is None:
        return GenerationDefaults()
    try:
        if model_path.is_dir():
            return _from_values(_hf_values(model_path / "generation_config.json"), _HF_KEYS)
        if model_path.suffix == ".gguf":
            return _from_values(_gguf_values(model_path), _GGUF_KEYS)
    except (OSError, ValueError) as exc:
        log.warning("ignoring the model's generation defaults (%s)", exc)
    return GenerationDefaults()


def _hf_values(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    if data.get("do_sample") is False:
        data = {**data, "temperature": 0.0}  # HF's greedy switch
    return data


def _gguf_values(path: Path) -> dict[str, Any]:
    # The engine's own parser: metadata only, in a fraction of a second (gguf.GGUFReader took 9-17 s
    # here, most of it decoding the vocabulary arrays this never reads).
    from tailserve.weights.gguf_file import read_gguf

    metadata = read_gguf(path).metadata
    return {key: value for key, value in metadata.items() if key in _GGUF_KEYS.values()}


def _from_values(values: dict[str, Any], keys: dict[str, str]) -> GenerationDefaults:
    def number(name: str) -> float | None:
        value = values.get(keys[name])
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    temperature, top_p, top_k = number("temperature"), number("top_p"), number("top_k")
    return GenerationDefaults(
        temperature=temperature if temperature is not None and temperature >= 0 else None,
        top_p=top_p if top_p is not None and 0 < top_p <= 1 else None,
        top_k=int(top_k) if top_k is not None and top_k >= 1 else None,
    )
