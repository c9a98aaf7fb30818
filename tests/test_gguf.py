"""GGUFFile: files written by the reference `gguf` package read back exactly; tensor bytes are
zero-copy read-only views; malformed, truncated and corrupted files raise GGUFError, never crash."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from oxibonsai import GGUFError, GGUFFile, OxiBonsaiError

Q1 = gguf.GGMLQuantizationType.Q1_0
BF16 = gguf.GGMLQuantizationType.BF16

METADATA: list[tuple[str, str, Any]] = [
    ("add_uint8", "t.u8", 200),
    ("add_int8", "t.i8", -100),
    ("add_uint16", "t.u16", 60000),
    ("add_int16", "t.i16", -30000),
    ("add_uint32", "t.u32", 4_000_000_000),
    ("add_int32", "t.i32", -2_000_000_000),
    ("add_uint64", "t.u64", 2**64 - 1),
    ("add_int64", "t.i64", -(2**63)),
    ("add_float32", "t.f32", 0.1),
    ("add_float64", "t.f64", -2.5e300),
    ("add_bool", "t.true", True),
    ("add_bool", "t.false", False),
    ("add_string", "t.str", "Grüße, 世界"),
    ("add_array", "t.strings", ["<s>", "hello", " world", "✓"]),
    ("add_array", "t.ints", [3, -1, 2]),
    ("add_array", "t.floats", [0.5, -1.25]),
    ("add_array", "t.bools", [True, False, True]),
    ("add_array", "t.nested", [[1, 2], [3], [[4.0], [5.0, 6.0]]]),
]


def write(path: Path, tensors: dict[str, tuple[np.ndarray, Any]], alignment: int | None = None) -> Path:
    """Writes a GGUF file with every kind of metadata and `tensors` (name -> (array, raw_dtype)).

    (The `gguf` writer skips empty strings and arrays; the Rust tests cover those.)"""
    w = gguf.GGUFWriter(path, "qwen3")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for method, key, value in METADATA:
        getattr(w, method)(key, value)
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Any]]:
    return {
        "token_embd.weight": (rng.integers(0, 256, (6, 256 // 128 * 18), dtype=np.uint8), Q1),
        "blk.0.attn_q.weight": (rng.integers(0, 256, (3, 128 // 128 * 18), dtype=np.uint8), Q1),
        "blk.0.attn_norm.weight": (rng.standard_normal(256).astype(np.float32), None),
        "half": (rng.standard_normal((2, 3)).astype(np.float16), None),
        "bf": (rng.integers(0, 256, (4, 5 * 2), dtype=np.uint8), BF16),
    }


@pytest.fixture
def model(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, dict[str, tuple[np.ndarray, Any]]]:
    tensors = model_tensors(rng)
    return write(tmp_path / "model.gguf", tensors), tensors


def test_metadata_round_trips_every_type(model: tuple[Path, Any]) -> None:
    f = GGUFFile(model[0])
    meta = f.metadata
    assert list(meta) == ["general.architecture"] + [key for _, key, _ in METADATA]
    assert meta["general.architecture"] == "qwen3"
    for method, key, value in METADATA:
        if method == "add_float32":
            assert meta[key] == float(np.float32(value))
        else:
            assert meta[key] == value, key
            assert type(meta[key]) is type(value), key


def test_header_properties(model: tuple[Path, Any]) -> None:
    f = GGUFFile(os.fspath(model[0]))
    assert (f.version, f.alignment) == (3, 32)
    assert f.data_offset % 32 == 0
    assert f.path == str(model[0])
    assert "version=3" in repr(f)


def test_tensor_infos_match_the_writer_and_the_reference_reader(model: tuple[Path, Any]) -> None:
    path, tensors = model
    f = GGUFFile(path)
    reference = gguf.GGUFReader(path)
    assert f.tensor_names() == list(tensors)
    expected = {
        "token_embd.weight": ((6, 256), "Q1_0", 6 * 2 * 18),
        "blk.0.attn_q.weight": ((3, 128), "Q1_0", 3 * 18),
        "blk.0.attn_norm.weight": ((256,), "F32", 1024),
        "half": ((2, 3), "F16", 12),
        "bf": ((4, 5), "BF16", 40),
    }
    for info, ref in zip(f.tensors(), reference.tensors, strict=True):
        shape, type_name, nbytes = expected[info["name"]]
        assert info == f.tensor_info(info["name"])
        assert info["shape"] == shape
        assert info["dims"] == tuple(reversed(shape))
        assert (info["type"], info["nbytes"]) == (type_name, nbytes)
        assert info["offset"] == ref.data_offset
        assert info["offset"] % f.alignment == 0


def test_tensor_bytes_equal_what_was_written(model: tuple[Path, Any]) -> None:
    path, tensors = model
    f = GGUFFile(path)
    for name, (array, _) in tensors.items():
        data = f.tensor_bytes(name)
        assert data.dtype == np.uint8 and data.ndim == 1
        assert data.tobytes() == array.tobytes(), name
    norm = f.tensor_bytes("blk.0.attn_norm.weight").view(np.float32)
    np.testing.assert_array_equal(norm, tensors["blk.0.attn_norm.weight"][0])


def test_tensor_bytes_are_read_only_views_that_keep_the_file_alive(model: tuple[Path, Any]) -> None:
    path, tensors = model
    f = GGUFFile(path)
    a, b = f.tensor_bytes("token_embd.weight"), f.tensor_bytes("token_embd.weight")
    assert a.ctypes.data == b.ctypes.data  # both view the mapping: no copy
    assert not a.flags.writeable and not a.flags.owndata
    assert isinstance(a.base, GGUFFile) and a.base is f  # the array keeps the file (and mapping) alive
    with pytest.raises(ValueError):
        a[0] = 1
    with pytest.raises(ValueError):
        a.flags.writeable = True
    del f, b
    gc.collect()
    os.remove(path)  # the mapping outlives the path, too
    assert a.tobytes() == tensors["token_embd.weight"][0].tobytes()


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_custom_alignment(tmp_path: Path, rng: np.random.Generator, alignment: int) -> None:
    tensors = model_tensors(rng)
    f = GGUFFile(write(tmp_path / "a.gguf", tensors, alignment))
    assert f.alignment == alignment
    assert f.metadata["general.alignment"] == alignment
    for info in f.tensors():
        assert info["offset"] % alignment == 0
        assert f.tensor_bytes(info["name"]).tobytes() == tensors[info["name"]][0].tobytes()


def test_missing_tensor_is_a_key_error(model: tuple[Path, Any]) -> None:
    f = GGUFFile(model[0])
    with pytest.raises(KeyError, match="nope"):
        f.tensor_info("nope")
    with pytest.raises(KeyError, match="nope"):
        f.tensor_bytes("nope")


def test_unknown_path_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(OSError):
        GGUFFile(tmp_path)


def test_a_text_file_is_a_gguf_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a model at all\n")
    with pytest.raises(GGUFError, match="notes.txt.*not a GGUF file"):
        GGUFFile(path)
    assert issubclass(GGUFError, OxiBonsaiError)


def test_truncated_files_raise_gguf_error(
    model: tuple[Path, Any], tmp_path: Path, rng: np.random.Generator
) -> None:
    full = model[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    data_end = max(t["offset"] + t["nbytes"] for t in GGUFFile(model[0]).tensors())  # padding follows
    # Every offset through the fixed header and first key, then a random sample up to the data's end
    # (the Rust tests cut a small file at every offset).
    for length in [*range(64), *rng.integers(64, data_end, size=200)]:
        cut.write_bytes(full[:length])
        with pytest.raises(GGUFError):
            GGUFFile(cut)


def test_random_byte_flips_raise_gguf_error_or_parse(
    model: tuple[Path, Any], tmp_path: Path, rng: np.random.Generator
) -> None:
    full = np.frombuffer(model[0].read_bytes(), dtype=np.uint8)
    header_end = GGUFFile(model[0]).data_offset
    bad = tmp_path / "bad.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        data = full.copy()
        at = rng.integers(0, header_end, size=rng.integers(1, 4))
        data[at] = rng.integers(0, 256, size=at.size, dtype=np.uint8)
        bad.write_bytes(data.tobytes())
        try:
            f = GGUFFile(bad)
        except GGUFError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        _ = f.metadata
        for name in f.tensor_names():
            assert f.tensor_bytes(name).size == f.tensor_info(name)["nbytes"]
    assert outcomes["error"] > 0
