"""quickdraft.loading.tensor_file: safetensors files written a tensor at a time and mapped back without a copy."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from quickdraft.loading.tensor_file import (
    ALIGN,
    PAD_PREFIX,
    TensorFile,
    TensorFileWriter,
    map_tensors,
    open_tensor_file,
)

META = {"fingerprint": "abc123", "what": "test"}


def sample_tensors() -> dict[str, torch.Tensor]:
    """One of each storable dtype, odd byte sizes (so the next tensor needs padding), an empty and a 0-dim tensor."""
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, 3, generator=g).bfloat16(),  # 42 bytes: the next one is padded
        "f16": torch.randn(5, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 128, (3, 3), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "i16": torch.randint(-1000, 1000, (4, 3), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(1 << 30), 1 << 30, (3,), generator=g, dtype=torch.int32),
        "i64": torch.tensor([-(1 << 40), 0, 1 << 40]),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "strided": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # not contiguous: stored as its values
    }


def write(path, tensors, meta=META, **kw):
    with TensorFileWriter(path, **kw) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
        return writer.finish(meta)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def no_temporaries(directory) -> bool:
    return not list(directory.glob("*.tmp"))


def test_round_trip_every_dtype_mapped_and_aligned(tmp_path):
    want = sample_tensors()
    path = tmp_path / "t.safetensors"
    assert write(path, want) == path
    assert no_temporaries(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable like any cache file, not mkstemp's 0o600
    tensors, metadata, mapping = map_tensors(path)
    assert metadata == META
    assert_same(tensors, want)
    assert not any(name.startswith(PAD_PREFIX) for name in tensors)
    for name, t in tensors.items():
        assert t.data_ptr() % ALIGN == 0, (name, t.data_ptr() % ALIGN)
    # zero-copy: every non-empty tensor points into the one mapping
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    for name, t in tensors.items():
        if t.numel():
            assert base <= t.data_ptr() < base + len(mapping), name
    # the mapping is private: writing through a tensor never reaches the file
    before = path.read_bytes()
    tensors["f32"].add_(1.0)
    assert path.read_bytes() == before
    entry = open_tensor_file(path, {"fingerprint": "abc123"}, "test file")
    assert isinstance(entry, TensorFile) and entry.metadata == META
    assert_same(entry.tensors, want)
    entry.release_pages()  # pages dropped from this process; the values come back from the file
    assert_same(entry.tensors, want)


def test_file_is_valid_safetensors(tmp_path):
    want = sample_tensors()
    path = write(tmp_path / "t.safetensors", want)
    loaded = load_file(str(path))
    pads = {k for k in loaded if k.startswith(PAD_PREFIX)}
    assert pads, "the odd-sized tensors should have needed padding"
    assert all(loaded[k].dtype == torch.uint8 and loaded[k].dim() == 1 and not loaded[k].any() for k in pads)
    assert_same({k: v for k, v in loaded.items() if k not in pads}, want)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == META


def test_only_pad_entries_fill_the_gaps(tmp_path):
    """Tensors already a multiple of the alignment need no pad entry; the data section has no holes either way."""
    path = write(tmp_path / "t.safetensors", {"a": torch.zeros(16), "b": torch.ones(32, dtype=torch.int16)})
    assert set(load_file(str(path))) == {"a", "b"}
    path = write(tmp_path / "u.safetensors", {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.ones(4)})
    assert {k for k in load_file(str(path)) if k.startswith(PAD_PREFIX)} == {f"{PAD_PREFIX}1"}


def test_empty_file_of_no_tensors(tmp_path):
    path = write(tmp_path / "none.safetensors", {})
    tensors, metadata, mapping = map_tensors(path)
    assert tensors == {} and metadata == META and mapping is None
    assert load_file(str(path)) == {}


def test_writer_refuses_bad_names_and_dtypes(tmp_path):
    path = tmp_path / "t.safetensors"
    with TensorFileWriter(path) as writer:
        writer.add("a", torch.zeros(2))
        with pytest.raises(ValueError, match="taken or reserved"):
            writer.add("a", torch.zeros(2))
        with pytest.raises(ValueError, match="taken or reserved"):
            writer.add(f"{PAD_PREFIX}7", torch.zeros(2))
        with pytest.raises(ValueError, match="cannot be stored"):
            writer.add("c", torch.zeros(2, dtype=torch.complex64))
        writer.finish(META)
    assert set(map_tensors(path)[0]) == {"a"}


def test_abort_leaves_nothing(tmp_path):
    path = tmp_path / "sub" / "t.safetensors"
    writer = TensorFileWriter(path)
    writer.add("a", torch.randn(100))
    writer.abort()
    assert not path.exists() and no_temporaries(path.parent) and not list(path.parent.iterdir())
    # an exception inside ``with`` aborts too
    with pytest.raises(RuntimeError, match="converting failed"):
        with TensorFileWriter(path) as writer:
            writer.add("a", torch.randn(100))
            raise RuntimeError("converting failed")
    assert not path.exists() and not list(path.parent.iterdir())


def test_header_that_does_not_fit_the_reserve_aborts(tmp_path):
    path = tmp_path / "t.safetensors"
    with pytest.raises(ValueError, match="does not fit"):
        write(path, {f"tensor{i}": torch.zeros(1) for i in range(20)}, reserve=256)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_finish_replaces_an_old_file_whole(tmp_path):
    path = write(tmp_path / "t.safetensors", {"old": torch.zeros(5)})
    writer = TensorFileWriter(path)
    writer.add("new", torch.ones(3))
    assert set(map_tensors(path)[0]) == {"old"}  # until finish, readers see the old file
    writer.finish(META)
    assert_same(map_tensors(path)[0], {"new": torch.ones(3)})
    assert no_temporaries(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "half", "last byte", "header only", "empty", "json array"])
def test_damaged_file_is_refused_and_removed(tmp_path, damage, caplog):
    path = write(tmp_path / "t.safetensors", sample_tensors())
    data = path.read_bytes()
    gen = torch.Generator().manual_seed(1)
    damaged = {
        "garbage": torch.randint(0, 256, (len(data),), generator=gen, dtype=torch.uint8).numpy().tobytes(),
        "half": data[: len(data) // 2],  # ends inside the reserved header
        "last byte": data[:-1],  # the last tensor does not fit
        "header only": data[: (1 << 20)],
        "empty": b"",
        "json array": (2).to_bytes(8, "little") + b"[]",
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(ValueError):
        map_tensors(path)
    with caplog.at_level("WARNING"):
        assert open_tensor_file(path, {"fingerprint": "abc123"}, "test file") is None
    assert not path.exists()
    assert "ignoring damaged test file" in caplog.text


def test_stale_or_missing_file(tmp_path):
    path = tmp_path / "t.safetensors"
    assert open_tensor_file(path, META, "test file") is None  # missing: nothing to do
    write(path, {"a": torch.zeros(2)})
    assert open_tensor_file(path, {"fingerprint": "other"}, "test file") is None  # stale: removed
    assert not path.exists()
    write(path, {"a": torch.zeros(2)}, meta={})
    assert open_tensor_file(path, {"fingerprint": "abc123"}, "test file") is None  # no metadata: stale
    assert not path.exists()


def test_offsets_outside_the_file_are_refused(tmp_path):
    """A well-formed header whose offsets do not match the shapes, or point past the end, is refused."""
    import json
    import struct

    for entry in ({"dtype": "F32", "shape": [4], "data_offsets": [0, 12]},  # 3 floats of room for 4
                  {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},  # past the end of the 8 data bytes
                  {"dtype": "F32", "shape": [-4], "data_offsets": [0, -16]},
                  {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}):
        header = json.dumps({"x": entry}).encode()
        path = tmp_path / "h.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
        with pytest.raises(ValueError):
            map_tensors(path)
    assert os.path.exists(path)  # map_tensors only reads


def _raw_file(path, header: dict, data: bytes) -> None:
    import json
    import struct

    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_hostile_headers_are_refused_without_a_crash(tmp_path, caplog):
    """A header another writer (or an attacker) made: bad metadata, overlapping tensors, deep nesting."""
    cases = {
        "metadata_list": ({"__metadata__": [1], "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, bytes(4)),
        "metadata_not_strings": ({"__metadata__": {"k": 1}, "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}},
                                 bytes(4)),
        "overlap": ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                     "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, bytes(8)),
    }
    for name, (header, data) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        _raw_file(path, header, data)
        with pytest.raises(ValueError):
            map_tensors(path)
        assert open_tensor_file(path, {}, "test cache") is None and not path.exists(), name
    deep = tmp_path / "deep.safetensors"
    text = ("[" * 100_000 + "]" * 100_000).encode()
    import struct

    deep.write_bytes(struct.pack("<Q", len(text)) + text)
    assert open_tensor_file(deep, {}, "test cache") is None and not deep.exists()


def test_misaligned_tensor_is_copied_with_its_values(tmp_path):
    path = tmp_path / "odd.safetensors"
    value = torch.arange(6, dtype=torch.float32)
    data = b"\x07" + value.numpy().tobytes()  # a 1-byte tensor first: the float32 one starts at an odd offset
    _raw_file(path, {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                     "x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]}}, data)
    tensors, _, _ = map_tensors(path)
    assert torch.equal(tensors["x"], value.view(2, 3)) and tensors["x"].data_ptr() % 4 == 0


def test_failed_finish_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError), TensorFileWriter(path) as writer:
        writer.add("a", torch.ones(3))
        writer.finish({})
    assert not path.exists() and no_temporaries(tmp_path)
