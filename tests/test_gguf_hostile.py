"""Hostile and damaged GGUF files: every count, length, type, dimension and offset of the header is bounded before
anything is allocated, and each bad field is a quick ModelLoadError naming the field, its value and what is allowed
(never MemoryError, OverflowError, struct.error, IndexError or a hang)."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFReader, GGUFValueType as VT, GGUFWriter

from quickdraft.errors import ModelLoadError
from quickdraft.loading import load_checkpoint
from quickdraft.loading import gguf as gguf_loader
from quickdraft.loading.gguf_metadata import MAX_ARRAY_LEN, MAX_KEY_LEN, MAX_KV, MAX_TENSORS

try:
    from fixtures_loading import cache_dir, one_torch_thread, smollm_gguf  # noqa: F401  (fixtures)
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import cache_dir, one_torch_thread, smollm_gguf  # noqa: F401

U64_MAX = (1 << 64) - 1
QUICK_S = 5.0  # a bounded header check takes milliseconds; this only catches loops over hostile counts


# ---- a GGUF writer of raw bytes, so every field can be set to anything ------------------------------------------
def string(text: bytes | str, length: int | None = None) -> bytes:
    text = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(text) if length is None else length) + text


def kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", value))


def array(key: str, item_type: int, length: int, items: bytes = b"") -> bytes:
    return kv(key, VT.ARRAY, struct.pack("<IQ", item_type, length) + items)


def tensor_info(name: str, dims: list[int], ttype: int = QT.F32, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (string(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset))


ARCH = kv("general.architecture", VT.STRING, string("llama"))
EMBD = tensor_info("token_embd.weight", [8, 4])  # 4 rows of 8 float32: 128 bytes of data


def gguf(kvs: list[bytes] = (ARCH,), infos: list[bytes] = (EMBD,), *, n_tensors: int | None = None,
         n_kv: int | None = None, version: int = 3, data: bytes | None = bytes(128), alignment: int = 32) -> bytes:
    """A GGUF file: header, key/values, tensor descriptions, then padding and ``data`` (None: the file ends
    with the header)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head if data is None else head + bytes(-len(head) % alignment) + data


CASES = {
    # the header's counts
    "magic only": (b"GGUF", r"the version at byte 4 needs bytes up to 8 but the file has 4 bytes"),
    "counts cut": (gguf()[:20], r"the key/value count at byte 16 needs bytes up to 24"),
    "version 1": (gguf(version=1), r"version 1, this reader supports versions 2, 3"),
    "version huge": (gguf(version=0x7FFFFFFF), r"version 2147483647, this reader supports"),
    "big-endian": (gguf(version=3 << 24), r"big-endian GGUF; only little-endian files are supported"),
    "tensor count 2^64-1": (gguf(n_tensors=U64_MAX),
                            rf"tensor count {U64_MAX:,} is more than the {MAX_TENSORS:,} allowed"),
    "tensor count past the file": (gguf(n_tensors=MAX_TENSORS), r"65,536 tensors and 1 key/values cannot fit in the "),
    "kv count 2^63": (gguf(n_kv=1 << 63), rf"key/value count {1 << 63:,} is more than the {MAX_KV:,} allowed"),
    "kv count past the file": (gguf(n_kv=5000), r"1 tensors and 5,000 key/values cannot fit"),
    # keys and values
    "key length 2^64-1": (gguf([string("k", U64_MAX)]), rf"key 0 has length {U64_MAX:,}, more than the "
                                                        rf"{MAX_KEY_LEN:,} bytes allowed"),
    "key past the end": (gguf([string("k", 60000)], data=None), r"key 0 at byte 32 needs bytes up to 60,032"),
    "key not UTF-8": (gguf([kv(b"general.\xff\xfe", VT.UINT32, bytes(4))]), r"key 0 is not valid UTF-8"),
    "key reserved": (gguf([u32("GGUF.version", 3)]), r"'GGUF.version': names starting with 'GGUF.' are reserved"),
    "key twice": (gguf([ARCH, ARCH]), r"key 'general.architecture' appears twice"),
    "value type 13": (gguf([kv("general.x", 13, bytes(8))]), r"value type of key 'general.x' is 13, not a GGUF "
                                                               r"value type \(UINT8=0, .*FLOAT64=12\)"),
    "value type 2^32-1": (gguf([kv("general.x", 0xFFFFFFFF, bytes(8))]), r"is 4294967295, not a GGUF value type"),
    "string length 2^62": (gguf([kv("general.name", VT.STRING, string("x", 1 << 62))]),
                           rf"the string value of 'general.name' at byte 56 needs bytes up to {56 + (1 << 62):,}"),
    "string past the end": (gguf([kv("general.name", VT.STRING, string("x", 1000))]),
                            r"the string value of 'general.name' at byte \d+ needs bytes up to \d"),
    "scalar cut": (gguf([ARCH, u32("general.x", 1)], [], data=None)[:-2], r"the value of 'general.x' at byte"),
    "array length 2^64-1": (gguf([array("general.a", VT.UINT8, U64_MAX)]),
                            rf"array 'general.a' has {U64_MAX:,} items, more than the {MAX_ARRAY_LEN:,} allowed"),
    "array past the end": (gguf([array("general.a", VT.UINT32, 1000)]), r"the 1,000 items of 'general.a' at byte"),
    "string array past the end": (gguf([array("tokenizer.ggml.tokens", VT.STRING, 900_000)]),
                                  r"array 'tokenizer.ggml.tokens' has 900,000 items, more than the \d+ bytes left"),
    "string in array too long": (gguf([array("general.a", VT.STRING, 2, string("ab") + string("x", 1 << 40))]),
                                 r"the string value of 'general.a' at byte \d+ needs bytes up to 1,099,511,627,\d+"),
    "array item type 99": (gguf([array("general.a", 99, 0)]), r"the item type of array 'general.a' is 99, not a "
                                                               r"GGUF value type"),
    "array of arrays": (gguf([array("general.a", VT.ARRAY, 1, struct.pack("<IQ", VT.UINT8, 1) + b"x")]),
                        r"'general.a' is an array of arrays; nested arrays are not supported"),
    "arrays too many items together": (
        gguf([array(f"general.a{i}", VT.UINT8, MAX_ARRAY_LEN, bytes(MAX_ARRAY_LEN)) for i in range(3)]),
        r"the arrays up to 'general.a2' hold 3,145,728 items together, more than the 2,097,152 allowed"),
    # alignment
    "alignment 0": (gguf([ARCH, u32("general.alignment", 0)]), r"general.alignment is 0; it must be a power of two"),
    "alignment 48": (gguf([ARCH, u32("general.alignment", 48)]), r"general.alignment is 48; it must be a power of two"),
    "alignment not u32": (gguf([ARCH, kv("general.alignment", VT.UINT64, struct.pack("<Q", 32))]),
                          r"general.alignment has value type 10, it must be UINT32 \(4\)"),
    # tensor descriptions
    "tensor name length 2^64-1": (gguf(infos=[string("t", U64_MAX)]), r"the name of tensor 0 has length "
                                                                     rf"{U64_MAX:,}, more than the 4,096 bytes"),
    "tensor name not UTF-8": (gguf(infos=[string(b"blk.\xc3") + struct.pack("<IQIQ", 1, 8, 0, 0)]),
                              r"the name of tensor 0 is not valid UTF-8"),
    "tensor twice": (gguf(infos=[EMBD, EMBD]), r"tensor 'token_embd.weight' appears twice"),
    "n_dims 2^32-1": (gguf(infos=[tensor_info("token_embd.weight", [8, 4], n_dims=0xFFFFFFFF)]),
                      r"tensor 'token_embd.weight' has 4,294,967,295 dimensions; 1 to 4 are allowed"),
    "n_dims 0": (gguf(infos=[tensor_info("token_embd.weight", [], n_dims=0)]), r"has 0 dimensions; 1 to 4 are allowed"),
    "n_dims 5": (gguf(infos=[tensor_info("token_embd.weight", [8, 4, 1, 1, 1])]), r"has 5 dimensions"),
    "dims overflow": (gguf(infos=[tensor_info("token_embd.weight", [1 << 63, 1 << 63, 1 << 63, U64_MAX])]),
                      r"tensor 'token_embd.weight' \(shape \[9223372036854775808, .*needs bytes up to [\d,]+ but the "
                      r"file has \d+ bytes"),
    "dim 0": (gguf(infos=[tensor_info("token_embd.weight", [8, 0])]), r"shape \[8, 0\]; every dimension must be "
                                                                      r"at least 1"),
    "dims past the end": (gguf(infos=[tensor_info("token_embd.weight", [8, 4])[:-12]], data=None),
                          r"the type of tensor 'token_embd.weight' at byte \d+ needs bytes up to"),
    "tensor type 99": (gguf(infos=[tensor_info("token_embd.weight", [8, 4], ttype=99)]),
                       r"tensor 'token_embd.weight' has GGML type id 99, a type quickdraft does not support; "
                       r"supported: F32, F16, BF16, Q4_0, .*Q1_0, Q2_0"),
    "tensor type 4 (removed Q4_2)": (gguf(infos=[tensor_info("token_embd.weight", [32, 4], ttype=4)]),
                                     r"has GGML type id 4, a type quickdraft does not support"),
    "tensor type 2^32-1": (gguf(infos=[tensor_info("token_embd.weight", [8, 4], ttype=0xFFFFFFFF)]),
                           r"has GGML type id 4294967295, a type quickdraft does not support"),
    "rows not whole blocks": (gguf(infos=[tensor_info("token_embd.weight", [33, 4], ttype=QT.Q4_0)]),
                              r"shape \[33, 4\] of type Q4_0, whose row length .* must be a multiple of its block "
                              r"size 32"),
    "tensors overlap": (gguf(infos=[EMBD, tensor_info("output_norm.weight", [8], offset=64)]),
                        r"tensor 'token_embd.weight' \(bytes [\d,]+ to [\d,]+\) overlaps tensor 'output_norm.weight'"),
    "offset past the end": (gguf(infos=[tensor_info("token_embd.weight", [8, 4], offset=1 << 40)]),
                            r"\(shape \[8, 4\], 128 bytes at offset 1,099,511,627,776\) needs bytes up to"),
    "offset 2^64-32": (gguf(infos=[tensor_info("token_embd.weight", [8, 4], offset=U64_MAX - 31)]),
                       r"at offset 18,446,744,073,709,551,584\) needs bytes up to 18,446,744,073,709,551,\d+"),
    "offset misaligned": (gguf(infos=[tensor_info("token_embd.weight", [8, 4], offset=4)]),
                          r"data offset 4, not a multiple of the alignment 32"),
    "data cut": (gguf(data=bytes(100)), r"needs bytes up to \d+ but the file has"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_header_field_is_a_quick_clear_error(tmp_path, cache_dir, name):
    content, message = CASES[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(content)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=message) as err:
        load_checkpoint(path)
    assert time.perf_counter() - start < QUICK_S
    assert str(path) in str(err.value)
    assert not (cache_dir / "weights").exists()  # a refused file leaves no header record to be served later


def test_the_hand_made_baseline_passes_the_header_checks(tmp_path, cache_dir):
    """The well-formed file the cases above break: its header is accepted, it only lacks a model's metadata."""
    path = tmp_path / "base.gguf"
    path.write_bytes(gguf())
    with pytest.raises(ModelLoadError, match="metadata is missing 'llama.embedding_length'"):
        load_checkpoint(path)


# ---- hostile metadata values in a file with a well-formed header -------------------------------------------------
BASE_KV = {
    "llama.block_count": (1, VT.UINT32), "llama.embedding_length": (8, VT.UINT32),
    "llama.feed_forward_length": (16, VT.UINT32), "llama.attention.head_count": (2, VT.UINT32),
    "llama.attention.head_count_kv": (1, VT.UINT32), "llama.context_length": (64, VT.UINT32),
}


def write_model(path: Path, extra_tensors: dict[str, np.ndarray] | None = None, **overrides: tuple) -> Path:
    """A complete 1-layer llama GGUF (hidden 8, 2 heads of 4, float32 zeros) with some metadata replaced
    (``a__b=(value, GGUFValueType)`` sets ``a.b``; a value None leaves the key out) and ``extra_tensors``."""
    w = GGUFWriter(str(path), "llama")
    for key, (value, vtype) in {**BASE_KV, **{k.replace("__", "."): v for k, v in overrides.items()}}.items():
        if value is None:  # left out
            continue
        w.add_key_value(key, value, vtype, sub_type=VT.UINT32 if vtype == VT.ARRAY else None)
    shapes = {"token_embd.weight": (16, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.ffn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8),
              "blk.0.attn_v.weight": (4, 8), "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


METADATA_CASES = {
    "block_count 2^31": (dict(llama__block_count=(1 << 31, VT.UINT32)),
                         r"'llama.block_count' is 2,147,483,648; allowed: 1 to 11"),
    "block_count 0": (dict(llama__block_count=(0, VT.UINT32)), r"'llama.block_count' is 0; allowed: 1 to 11"),
    "embedding_length a string": (dict(llama__embedding_length=("eight", VT.STRING)),
                                  r"'llama.embedding_length' is str 'eight'; it must be an integer"),
    "head_count 0": (dict(llama__attention__head_count=(0, VT.UINT32)), r"'llama.attention.head_count' is 0; allowed"),
    "head_count_kv an array": (dict(llama__attention__head_count_kv=([1, 1], VT.ARRAY)),
                               r"'llama.attention.head_count_kv' is list \[1, 1\]; it must be an integer"),
    "head_count_kv above head_count": (dict(llama__attention__head_count_kv=(3, VT.UINT32)),
                                       r"'llama.attention.head_count_kv' is 3; allowed: 1 to 2"),
    "head dim odd": (dict(llama__attention__key_length=(3, VT.UINT32)), r"the head dimension is 3; rotary"),
    "context_length 2^40": (dict(llama__context_length=(1 << 40, VT.UINT64)),
                            r"'llama.context_length' is 1,099,511,627,776; allowed: 1 to 16,777,216"),
    "rope base NaN": (dict(llama__rope__freq_base=(float("nan"), VT.FLOAT32)),
                      r"'llama.rope.freq_base' is float nan; it must be a positive finite number"),
    "rms eps negative": (dict(llama__attention__layer_norm_rms_epsilon=(-1.0, VT.FLOAT32)),
                         r"'llama.attention.layer_norm_rms_epsilon' is float -1.0; it must be a positive"),
    "chat template a number": (dict(tokenizer__chat_template=(7, VT.UINT32)),
                               r"'tokenizer.chat_template' is int 7; it must be a string"),
    "feed_forward_length missing": (dict(llama__feed_forward_length=(None, None)), r"missing 'llama.feed_forward"),
}


def rope_freqs(*values: float, dtype: type = np.float32) -> dict[str, np.ndarray]:
    return {"rope_freqs.weight": np.array(values, dtype=dtype)}


# RoPE: a head of 4 has 2 frequencies, so Llama 3's rope_freqs holds 2 positive divisors
METADATA_CASES.update({
    "rope_freqs too short": (dict(extra_tensors=rope_freqs(1.0)), r"tensor rope_freqs.weight has shape \(1,\); RoPE "
                                                                  r"over 4 dims of a head needs \(2,\), one factor per"),
    "rope_freqs too long": (dict(extra_tensors=rope_freqs(*[1.0] * 1000)), r"rope_freqs.weight has shape \(1000,\)"),
    "rope_freqs 2-D": (dict(extra_tensors={"rope_freqs.weight": np.ones((2, 2), np.float32)}),
                       r"rope_freqs.weight has shape \(2, 2\)"),
    "rope_freqs NaN": (dict(extra_tensors=rope_freqs(1.0, float("nan"))),
                       r"tensor rope_freqs.weight holds nan at index 1; RoPE frequency factors must be positive "
                       r"finite numbers"),
    "rope_freqs 0": (dict(extra_tensors=rope_freqs(0.0, 1.0)), r"rope_freqs.weight holds 0.0 at index 0"),
    "rope_freqs negative": (dict(extra_tensors=rope_freqs(1.0, -8.0)), r"rope_freqs.weight holds -8.0 at index 1"),
    "rope_freqs infinite (F16)": (dict(extra_tensors=rope_freqs(np.inf, 1.0, dtype=np.float16)),
                                 r"rope_freqs.weight holds inf at index 0"),
    "rope scaling type a number": (dict(llama__rope__scaling__type=(2, VT.UINT32)),
                                   r"RoPE scaling int 2 \(llama.rope.scaling.type\) is not supported; supported: "
                                   r"none, linear"),
    "rope scaling yarn": (dict(llama__rope__scaling__type=("yarn", VT.STRING)),
                          r"RoPE scaling str 'yarn' \(llama.rope.scaling.type\) is not supported"),
    "rope factor NaN": (dict(llama__rope__scaling__factor=(float("nan"), VT.FLOAT32)),
                        r"'llama.rope.scaling.factor' is float nan; it must be a positive finite number"),
    "rope dimension count odd": (dict(llama__rope__dimension_count=(3, VT.UINT32)),
                                 r"'llama.rope.dimension_count' is 3 but the head dimension is 4"),
})


@pytest.mark.parametrize("name", list(METADATA_CASES))
def test_hostile_metadata_value_is_a_clear_error(tmp_path, cache_dir, name):
    overrides, message = METADATA_CASES[name]
    path = write_model(tmp_path / "m.gguf", **overrides)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path, use_cache=False)
    assert time.perf_counter() - start < QUICK_S


def test_the_metadata_baseline_loads(tmp_path, cache_dir, monkeypatch):
    ckpt = load_checkpoint(write_model(tmp_path / "m.gguf", tokenizer__ggml__bos_token_id=(99, VT.UINT32),
                                       tokenizer__ggml__eos_token_id=(15, VT.UINT32)), use_cache=False)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (1, 8, 2, 1, 4)
    assert cfg.bos_token_id is None and cfg.eos_token_ids == (15,)  # 99 is outside the vocabulary of 16: dropped
    # the checked config is what the header record keeps: a load from the record gives the same one
    path = tmp_path / "m.gguf"
    assert load_checkpoint(path).config == cfg  # parsed, record written
    monkeypatch.setattr(gguf_loader, "read_header", lambda *a, **k: pytest.fail("the header record was not used"))
    assert load_checkpoint(path).config == cfg  # from the record


# ---- a real file cut short anywhere ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_layout() -> tuple[Path, int, int]:
    """The real SmolLM2 GGUF, where its tensor data starts and where its last tensor ends."""
    path = smollm_gguf()
    reader = GGUFReader(path)
    return path, reader.data_offset, max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)


@pytest.mark.parametrize("where", ["magic", "counts", "first key", "token list", "merges", "tensor table",
                                   "tensor data", "last byte"])
def test_truncated_real_gguf_is_a_quick_clear_error(tmp_path, cache_dir, smollm2_layout, where):
    source, data_start, end = smollm2_layout
    cut = {"magic": 3, "counts": 20, "first key": 40, "token list": 1 << 19, "merges": 1 << 20,
           "tensor table": data_start - 100, "tensor data": data_start + (end - data_start) // 2,
           "last byte": end - 1}[where]
    path = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(cut))
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="not a GGUF file|corrupt or truncated") as err:
        load_checkpoint(path)
    assert time.perf_counter() - start < QUICK_S
    if where != "magic":
        assert f"the file has {cut:,} bytes" in str(err.value)
    assert not (cache_dir / "weights").exists()  # nothing recorded of the refused file
