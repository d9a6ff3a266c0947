"""Our GGUF parser reads back what the `gguf` package's writer wrote: metadata of every kind, and
tensor bytes in HF row order, quantized blocks untouched."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tailserve.errors import ModelLoadError
from tailserve.weights.formats import dequantize_tensor
from tailserve.weights.gguf_file import read_gguf


def test_metadata_and_tensors_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_float32("t.f32", 1.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strs", ["a", "bb", "ccc"])
    writer.add_array("t.ints", [1, 2, 3])
    dense = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    half = np.linspace(-1, 1, 3 * 32, dtype=np.float16).reshape(3, 32)
    floats = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(floats, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("dense", dense)
    writer.add_tensor("half", half)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    f = read_gguf(path)
    assert f.metadata["general.architecture"] == "llama"
    assert (f.metadata["t.u32"], f.metadata["t.f32"], f.metadata["t.bool"]) == (7, 1.5, True)
    assert f.metadata["t.str"] == "héllo"
    assert f.metadata["t.strs"] == ["a", "bb", "ccc"] and f.metadata["t.ints"] == [1, 2, 3]
    assert [(t.type_name, t.shape) for t in f.tensors.values()] == [
        ("F32", (64, 32)),
        ("F16", (3, 32)),
        ("Q8_0", (16, 64)),
    ]
    assert torch.equal(dequantize_tensor(f.tensors["dense"]), torch.from_numpy(dense))
    assert torch.equal(dequantize_tensor(f.tensors["half"]), torch.from_numpy(half.astype(np.float32)))
    assert np.array_equal(f.tensors["q8"].data, q8)  # blocks as stored
    ref = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(
        dequantize_tensor(f.tensors["q8"]), torch.from_numpy(np.asarray(ref, dtype=np.float32))
    )


def test_not_a_gguf_file_is_a_typed_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(bad)
