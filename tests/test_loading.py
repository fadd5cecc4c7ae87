"""GGUF and Hugging Face loading: equality with transformers and gguf-py, clear errors, weight cache."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, GGUFWriter

from quickdraft.config import ModelConfig
from quickdraft.errors import ModelLoadError
from quickdraft.loading import Checkpoint, load_checkpoint
from quickdraft.loading import gguf as gguf_loader
from quickdraft.loading import weight_cache
from quickdraft.loading.checkpoint import fingerprint
from quickdraft.loading.gguf import load_gguf
from quickdraft.loading.hf import load_hf_dir

try:
    from fixtures_loading import (  # noqa: F401  (fixtures)
        ALL_TYPES, TINY, cache_dir, one_torch_thread, save_tiny_hf, smollm_gguf, write_tiny_gguf,
    )
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import (  # noqa: F401
        ALL_TYPES, TINY, cache_dir, one_torch_thread, save_tiny_hf, smollm_gguf, write_tiny_gguf,
    )


def assert_tensors_equal(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor | np.ndarray], rtol: float = 1e-6):
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for name, want in ref.items():
        want = torch.as_tensor(np.asarray(want)) if not isinstance(want, torch.Tensor) else want
        got = ours[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=0, msg=name)


# ----------------------------------------------------------------------------- real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """The real SmolLM2 GGUF, loaded once with a fresh weight cache (a cache miss)."""
    cache = tmp_path_factory.mktemp("smollm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUICKDRAFT_CACHE_DIR", str(cache))
        ckpt = load_checkpoint("smollm2-135m")
    return ckpt, cache


@pytest.mark.slow
def test_smollm_equals_transformers_gguf_load(smollm, smollm2_transformers):
    """Same tensors as transformers' own GGUF loader (dequantization, names, q/k un-permutation)."""
    ckpt, _ = smollm
    # transformers' from_pretrained(dir, gguf_file=name) in float32 (conftest; test_parity.py runs the same model):
    # its loader reads the config, including the head counts it un-permutes q/k with, from the file itself
    hf = smollm2_transformers
    assert hf.config.num_attention_heads == 9 and hf.config.num_key_value_heads == 3
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    ref = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert all(v.dtype == torch.float32 for v in ref.values())
    assert torch.equal(ckpt.tensors["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"])  # tied: read twice
    ours = {k: v for k, v in ckpt.tensors.items() if k != "lm_head.weight"}
    assert_tensors_equal(ours, ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref), "expected bit-exact equality"
    assert set(hf.state_dict()) == set(ckpt.tensors)


def test_smollm_checkpoint_fields(smollm):
    ckpt, _ = smollm
    cfg = ckpt.config
    assert cfg == ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=cfg.rms_norm_eps, attention_bias=False, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert ckpt.source == smollm_gguf().resolve()
    assert ckpt.quantization == "Q4_1"
    assert ckpt.hf_dir is None
    assert len(ckpt.fingerprint) == 32
    assert ckpt.chat_template and "<|im_start|>" in ckpt.chat_template
    meta = ckpt.gguf_metadata
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert all(t.dtype == torch.float32 for t in ckpt.tensors.values())
    assert sum(t.numel() for k, t in ckpt.tensors.items() if k != "lm_head.weight") == cfg.num_parameters


def test_smollm_tensors_fit_the_transformer(smollm):
    from quickdraft.models.transformer import Transformer

    ckpt, _ = smollm
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    model.load_state_dict(ckpt.tensors, strict=True, assign=True)


def test_second_load_uses_weight_cache(smollm, monkeypatch):
    """The first load stored the parsed header (a JSON record, no weights); the second reads only that."""
    ckpt, cache = smollm
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(cache))
    assert [p.name for p in (cache / "weights").iterdir()] == [weight_cache.index_path(ckpt.fingerprint).name]
    assert weight_cache.load_index(ckpt.fingerprint)["fingerprint"] == ckpt.fingerprint

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed although the weight cache holds its header")

    monkeypatch.setattr(gguf_loader, "read_header", no_parse)
    start = time.perf_counter()
    again = load_checkpoint(smollm_gguf())
    elapsed = time.perf_counter() - start
    assert elapsed < 5, elapsed
    assert again.config == ckpt.config and again.fingerprint == ckpt.fingerprint
    assert again.gguf_metadata == ckpt.gguf_metadata and again.chat_template == ckpt.chat_template
    assert again.quantization == ckpt.quantization and again.tensor_types == ckpt.tensor_types
    assert again.block_types == ckpt.block_types
    assert set(again.tensors) == set(ckpt.tensors) and set(again.blocks) == set(ckpt.blocks)
    # offsets as recorded: the first, a permuted q/k, and the last tensor of the file read the same
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert np.array_equal(np.asarray(again.blocks[name]), np.asarray(ckpt.blocks[name])), name
        assert torch.equal(again.tensors[name], ckpt.tensors[name]), name
    assert torch.equal(again.tensors["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"])
    assert list((cache / "weights").glob("*.safetensors")) == []  # loading writes no float weights


# ----------------------------------------------------------------------------- tiny GGUFs (every type)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_tiny_llama_every_type(tmp_path, cache_dir, qtype):
    path = tmp_path / "tiny.gguf"
    original, expected = write_tiny_gguf(path, "llama", qtype)
    ckpt = load_gguf(path)
    assert_tensors_equal(ckpt.tensors, expected)
    if qtype == QT.F32:  # the round trip through llama.cpp's permutation is exact
        assert all(torch.equal(ckpt.tensors[k], torch.from_numpy(v)) for k, v in original.items())
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        2, 256, 4, 2, 64, TINY["vocab"])
    assert cfg.rope_theta == 50000.0 and cfg.max_position_embeddings == 512 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_tiny_other_architectures_round_trip(tmp_path, cache_dir, arch):
    path = tmp_path / f"{arch}.gguf"
    original, expected = write_tiny_gguf(path, arch, QT.F32, tied=True)
    ckpt = load_gguf(path)
    assert ckpt.config.architecture == arch
    assert ckpt.config.attention_bias == (arch == "qwen2")
    assert ckpt.config.tie_word_embeddings
    assert torch.equal(ckpt.tensors["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"])
    assert "lm_head.weight" not in ckpt.blocks  # stored once, in the file as in the checkpoint
    assert set(ckpt.tensors) == set(original)
    assert all(torch.equal(ckpt.tensors[k], torch.from_numpy(v)) for k, v in original.items())


def test_tiny_qwen2_equals_transformers(tmp_path, cache_dir):
    """Qwen2 q/k are not permuted by llama.cpp, and biases load: check against transformers."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, "qwen2", QT.Q8_0)
    ckpt = load_gguf(path)
    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert_tensors_equal(ckpt.tensors, ref)


def test_eos_ids_add_chatml_end_of_turn(tmp_path, cache_dir):
    write_tiny_gguf(tmp_path / "q.gguf", "qwen2", QT.F32)
    write_tiny_gguf(tmp_path / "l.gguf", "llama", QT.F32)
    write_tiny_gguf(tmp_path / "plain.gguf", "llama", QT.F32, with_chatml=False)
    q = load_gguf(tmp_path / "q.gguf").config
    assert q.eos_token_ids == (0, 2) and q.bos_token_id == 1  # declared <|endoftext|>, plus <|im_end|>
    assert load_gguf(tmp_path / "l.gguf").config.eos_token_ids == (0, 2)
    assert load_gguf(tmp_path / "plain.gguf").config.eos_token_ids == (0,)


def test_dtype_conversion_and_one_header_record_for_every_dtype(tmp_path, cache_dir):
    path = tmp_path / "t.gguf"
    _, expected = write_tiny_gguf(path, "llama", QT.Q4_0)
    bf = load_checkpoint(path, torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in bf.tensors.values())
    ref = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in expected.items()}
    assert all(torch.equal(bf.tensors[k], ref[k]) for k in ref)
    f32 = load_checkpoint(path, torch.float32)
    assert f32.dtype == torch.float32 and all(t.dtype == torch.float32 for t in f32.tensors.values())
    # the header record does not depend on the dtype, and loading writes no weights
    assert sorted(p.name for p in (cache_dir / "weights").iterdir()) == [weight_cache.index_path(bf.fingerprint).name]
    assert not list((cache_dir / "weights").glob("*.tmp"))


# ----------------------------------------------------------------------------- weight cache: the header record


def _count_parses(monkeypatch) -> list[int]:
    """Count the GGUF header parses (gguf_metadata.read_header, as gguf.py calls it)."""
    calls = []
    real = gguf_loader.read_header

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(gguf_loader, "read_header", counting)
    return calls


def _assert_same_checkpoint(a: Checkpoint, b: Checkpoint) -> None:
    assert a.config == b.config and a.fingerprint == b.fingerprint and a.source == b.source
    assert a.gguf_metadata == b.gguf_metadata and a.chat_template == b.chat_template
    assert a.quantization == b.quantization and a.tensor_types == b.tensor_types and a.block_types == b.block_types
    assert set(a.blocks) == set(b.blocks)
    assert all(np.array_equal(np.asarray(a.blocks[k]), np.asarray(b.blocks[k])) for k in a.blocks)


def test_header_record_second_load_does_not_parse(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "t.gguf"
    _, expected = write_tiny_gguf(path, "llama", QT.Q8_0, tied=True)
    parses = _count_parses(monkeypatch)
    first = load_gguf(path)
    assert len(parses) == 1
    record = weight_cache.index_path(first.fingerprint)
    assert [p.name for p in (cache_dir / "weights").iterdir()] == [record.name]  # the header, no weights
    assert json.loads(record.read_text())["fingerprint"] == first.fingerprint
    monkeypatch.setattr(gguf_loader, "read_header", lambda *a, **k: pytest.fail("the header record was not used"))
    second = load_gguf(path)
    _assert_same_checkpoint(second, first)
    assert_tensors_equal(second.tensors, expected)
    assert torch.equal(second.tensors["lm_head.weight"], second.tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty", "not json object", "wrong fingerprint",
                                    "missing fields", "bad offset"])
def test_damaged_header_record_is_rebuilt(tmp_path, cache_dir, monkeypatch, caplog, damage):
    path = tmp_path / "t.gguf"
    _, expected = write_tiny_gguf(path, "llama", QT.Q4_1)
    first = load_gguf(path)
    record = weight_cache.index_path(first.fingerprint)
    data = record.read_bytes()
    good = json.loads(data)
    bad_offset = json.loads(data)
    next(iter(bad_offset["tensors"].values()))["offset"] = "not a number"
    record.write_bytes({
        "garbage": os.urandom(len(data)),
        "truncate": data[: len(data) // 2],
        "empty": b"",
        "not json object": b"[1, 2, 3]",
        "wrong fingerprint": json.dumps({**good, "fingerprint": "0" * 32}).encode(),
        "missing fields": json.dumps({"fingerprint": first.fingerprint}).encode(),
        "bad offset": json.dumps(bad_offset).encode(),
    }[damage])
    parses = _count_parses(monkeypatch)
    with caplog.at_level("WARNING"):
        again = load_gguf(path)
    assert len(parses) == 1  # the damaged record was ignored: parsed again
    assert "ignoring damaged weight cache record" in caplog.text
    _assert_same_checkpoint(again, first)
    assert_tensors_equal(again.tensors, expected)
    assert weight_cache.load_index(first.fingerprint) == good  # rebuilt and valid
    load_gguf(path)
    assert len(parses) == 1  # and used
    assert not list((cache_dir / "weights").glob("*.tmp"))


def test_changed_source_misses_cache(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "llama", QT.F32, seed=1)
    fp1 = load_gguf(path).fingerprint
    assert fingerprint(path) == fp1
    _, expected = write_tiny_gguf(path, "llama", QT.F32, seed=2)  # same path and size, new content
    parses = _count_parses(monkeypatch)
    ckpt = load_gguf(path)
    assert ckpt.fingerprint != fp1 and len(parses) == 1
    assert weight_cache.index_path(ckpt.fingerprint).is_file()
    assert_tensors_equal(ckpt.tensors, expected)


def test_use_cache_false_writes_nothing(tmp_path, cache_dir, monkeypatch):
    from quickdraft.loading.quantize import load_model

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "llama", QT.F16)
    ckpt = load_gguf(path, use_cache=False)
    load_model(ckpt, "float32", use_cache=False)
    load_model(ckpt, "int8", use_cache=False)
    for sub in ("weights", "quantized"):  # (the kernel build cache, kernels/, is no weight cache)
        assert not (cache_dir / sub).exists() or not list((cache_dir / sub).iterdir()), sub
    # nor does it read the cache: a stored record is not used
    load_gguf(path)
    parses = _count_parses(monkeypatch)
    load_gguf(path, use_cache=False)
    assert len(parses) == 1


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    from quickdraft.loading.quantize import load_model

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(blocker))
    path = tmp_path / "t.gguf"
    _, expected = write_tiny_gguf(path, "llama", QT.Q5_1)
    ckpt = load_gguf(path)
    assert_tensors_equal(ckpt.tensors, expected)
    assert_tensors_equal(load_gguf(path).tensors, expected)
    ids = [1, 5, 9, 2, 7]
    uncached = _logits(load_model(ckpt, "float32", use_cache=False), ids)
    assert torch.equal(_logits(load_model(ckpt, "float32"), ids), uncached)
    assert torch.equal(_logits(load_model(ckpt, "int8"), ids), _logits(load_model(ckpt, "int8", use_cache=False), ids))
    assert blocker.read_text() == "not a directory"


# ----------------------------------------------------------------------------- weight cache: float weights


def _logits(model, ids: list[int]) -> torch.Tensor:
    from quickdraft.kv import ForwardItem, ModelRunner, SequenceKV

    runner = ModelRunner("t", model, 8 << 20)
    kv = SequenceKV()
    with torch.inference_mode():
        (out,) = runner.forward([ForwardItem(kv, ids, len(ids))])
    runner.free(kv)
    return out


def _mapped_entries(monkeypatch) -> list:
    """The float weight cache files weight_cache.float_weights maps (TensorFile or None), in order."""
    opened = []
    real = weight_cache.open_tensor_file

    def spy(*a, **k):
        opened.append(real(*a, **k))
        return opened[-1]

    monkeypatch.setattr(weight_cache, "open_tensor_file", spy)
    return opened


def test_float_model_writes_float_cache_once_and_maps_it(tmp_path, cache_dir, monkeypatch):
    from quickdraft.loading.quantize import load_model
    from quickdraft.loading.tensor_file import map_tensors

    path = tmp_path / "t.gguf"
    _, expected = write_tiny_gguf(path, "llama", QT.Q8_0, tied=True)
    ckpt = load_gguf(path)
    ids = [1, 5, 9, 2, 7, 3]
    direct = _logits(load_model(ckpt, "float32", use_cache=False), ids)  # from the dequantized tensors
    assert not list((cache_dir / "weights").glob("*.safetensors"))

    first = load_model(ckpt, "float32")
    entry = weight_cache.cache_path(ckpt.fingerprint, torch.float32)
    assert [p.name for p in (cache_dir / "weights").glob("*.safetensors")] == [entry.name]
    assert not list((cache_dir / "weights").glob("*.tmp"))
    tensors, meta, _ = map_tensors(entry)
    # every tensor once: the tied lm_head is the embedding, not stored again
    assert set(tensors) == set(ckpt.tensors) - {"lm_head.weight"}
    assert meta["fingerprint"] == ckpt.fingerprint and meta["dtype"] == "float32"
    assert all(torch.equal(tensors[k], ckpt.tensors[k]) for k in tensors)
    assert torch.equal(_logits(first, ids), direct)

    # the second build maps the file: nothing dequantized, nothing written, the embedding not copied
    stamp = entry.stat().st_mtime_ns, entry.stat().st_ino
    monkeypatch.setattr(gguf_loader, "dequantize", lambda *a, **k: pytest.fail("dequantized despite the cache"))
    monkeypatch.setattr(weight_cache, "TensorFileWriter", lambda *a, **k: pytest.fail("the cache was written again"))
    opened = _mapped_entries(monkeypatch)
    second = load_model(ckpt, "float32")
    assert len(opened) == 1 and opened[0] is not None
    embed = second.model.embed_tokens.weight
    assert embed.data_ptr() == opened[0].tensors["model.embed_tokens.weight"].data_ptr()
    assert torch.equal(embed, torch.from_numpy(expected["model.embed_tokens.weight"]))
    assert torch.equal(_logits(second, ids), direct)
    assert (entry.stat().st_mtime_ns, entry.stat().st_ino) == stamp


def test_float_cache_per_dtype_and_none_for_hf_dirs(tmp_path, cache_dir):
    from quickdraft.loading.quantize import load_model

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "qwen2", QT.Q4_0)
    for dtype in (torch.bfloat16, torch.float32):
        ckpt = load_checkpoint(path, dtype)
        model = load_model(ckpt, str(dtype).removeprefix("torch."))
        assert model.model.embed_tokens.weight.dtype == dtype
        assert weight_cache.cache_path(ckpt.fingerprint, dtype).is_file()
    assert len(list((cache_dir / "weights").glob("*.safetensors"))) == 2
    hf = tmp_path / "hf"
    save_tiny_hf(hf, "llama")
    load_model(load_checkpoint(hf), "float32")  # mapped from its own safetensors: nothing to cache
    assert len(list((cache_dir / "weights").glob("*.safetensors"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty", "stale"])
def test_damaged_float_cache_is_rebuilt(tmp_path, cache_dir, caplog, damage):
    from quickdraft.loading.quantize import load_model
    from quickdraft.loading.tensor_file import TensorFileWriter, map_tensors

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "llama", QT.Q4_1)
    ckpt = load_gguf(path)
    ids = [4, 8, 15, 16, 23, 42]
    expected = _logits(load_model(ckpt, "float32"), ids)
    entry = weight_cache.cache_path(ckpt.fingerprint, torch.float32)
    data = entry.read_bytes()
    if damage == "stale":  # a whole file of other tensors under the same name
        with TensorFileWriter(entry) as writer:
            writer.add("model.embed_tokens.weight", torch.zeros(3))
            writer.finish(map_tensors(entry)[1])
    else:
        entry.write_bytes({"garbage": os.urandom(len(data)), "truncate": data[: len(data) // 2], "empty": b""}[damage])
    with caplog.at_level("WARNING"):
        again = load_model(ckpt, "float32")
    assert torch.equal(_logits(again, ids), expected)
    if damage != "stale":
        assert "ignoring damaged weight cache" in caplog.text
    tensors, meta, _ = map_tensors(entry)  # rebuilt and valid
    assert set(tensors) == set(ckpt.tensors) and meta["fingerprint"] == ckpt.fingerprint  # untied: lm_head stored
    assert all(torch.equal(tensors[k], ckpt.tensors[k]) for k in tensors)
    assert not list((cache_dir / "weights").glob("*.tmp"))


# ----------------------------------------------------------------------------- GGUF errors


def test_missing_path_names_path_and_packaged_models(tmp_path, cache_dir):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelLoadError) as exc:
        load_checkpoint(str(missing))
    msg = str(exc.value)
    assert str(missing) in msg and "smollm2-135m" in msg and "qwen2.5-coder-1.5b" in msg


@pytest.mark.parametrize("name", ["notes.gguf", "weights.bin"])
def test_non_gguf_file(tmp_path, cache_dir, name):
    path = tmp_path / name
    path.write_bytes(b"hello, this is not a model\n" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(path)


def test_truncated_real_gguf(tmp_path, cache_dir):
    path = tmp_path / "cut.gguf"
    with open(smollm_gguf(), "rb") as f:
        path.write_bytes(f.read(1 << 20))  # ends inside the token list
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_checkpoint(path)


def test_truncated_tensor_data(tmp_path, cache_dir):
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "llama", QT.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize("where", ["version", "header"])
def test_corrupt_header(tmp_path, cache_dir, where):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, "llama", QT.F32)
    data = bytearray(path.read_bytes())
    if where == "version":
        data[4:8] = b"\xff\xff\xff\x7f"
    else:
        data[24:2048] = np.random.default_rng(0).integers(0, 256, 2024, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_checkpoint(path)


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_unsupported_architecture(tmp_path, cache_dir, arch):
    path = tmp_path / f"{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as exc:
        load_checkpoint(path)
    assert f"unsupported architecture '{arch}'; supported: llama, mistral, qwen2" in str(exc.value)


@pytest.mark.parametrize("qtype", [QT.Q8_K], ids=lambda q: q.name)
def test_unsupported_quant_type(tmp_path, cache_dir, qtype):
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, "llama", qtype)
    with pytest.raises(ModelLoadError) as exc:
        load_checkpoint(path)
    msg = str(exc.value)
    assert qtype.name in msg and "supported: F32, F16, BF16, Q4_0" in msg and "Q6_K" in msg


def test_missing_tensor_is_reported(tmp_path, cache_dir):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="missing tensors model.norm.weight"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("model_type,tied,shard", [("llama", False, False), ("qwen2", True, False), ("mistral", False, True)])
def test_hf_dir_equals_transformers_state_dict(tmp_path, model_type, tied, shard):
    ref = save_tiny_hf(tmp_path, model_type, tied=tied, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ckpt = load_checkpoint(tmp_path)
    assert isinstance(ckpt, Checkpoint) and ckpt.hf_dir == tmp_path.resolve() and ckpt.gguf_metadata is None
    assert ckpt.quantization == "safetensors"
    assert set(ckpt.tensors) == set(ref)
    assert all(torch.equal(ckpt.tensors[k], ref[k]) for k in ref)
    cfg = ckpt.config
    assert cfg.architecture == model_type and cfg.attention_bias == (model_type == "qwen2")
    assert cfg.tie_word_embeddings == tied
    if tied:
        assert ckpt.tensors["lm_head.weight"] is ckpt.tensors["model.embed_tokens.weight"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert cfg.eos_token_ids == (0, 2, 5) and cfg.bos_token_id == 1  # config.json then generation_config.json
    from quickdraft.models.transformer import Transformer

    Transformer(cfg).load_state_dict(ckpt.tensors, strict=True)


def test_hf_dir_dtype_and_chat_template(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    assert load_hf_dir(tmp_path, torch.float32).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    ckpt = load_hf_dir(tmp_path, torch.bfloat16)
    assert ckpt.chat_template == "{{ messages }}"
    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())
    (tmp_path / "chat_template.jinja").write_text("{{ jinja }}")
    assert load_hf_dir(tmp_path, torch.float32).chat_template == "{{ jinja }}"


def test_hf_dir_without_weights(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"has no \*\.safetensors weights.*pytorch_model\.bin"):
        load_checkpoint(tmp_path)


def test_hf_dir_without_config(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_checkpoint(tmp_path)


def test_hf_dir_unsupported_model_type(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'; supported: llama, mistral, qwen2"):
        load_checkpoint(tmp_path)


def test_hf_dir_missing_shard_and_corrupt_file(tmp_path):
    save_tiny_hf(tmp_path, "llama", shard=True)
    shards = sorted(tmp_path.glob("*.safetensors"))
    shards[0].write_bytes(b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        load_checkpoint(tmp_path)
    shards[0].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_checkpoint(tmp_path)


def test_fingerprint_tracks_content(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"x" * (3 << 20))
    fp = fingerprint(a)
    assert fingerprint(a) == fp
    st = a.stat()
    with open(a, "r+b") as f:
        f.write(b"y")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime, different first MiB
    assert fingerprint(a) != fp
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    fpd = fingerprint(d)
    (d / "model.safetensors").write_bytes(b"z")
    assert fingerprint(d) != fpd
