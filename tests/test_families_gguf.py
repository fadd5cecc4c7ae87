"""GGUF files of the families beyond Llama/Qwen2, written here with gguf-py's GGUFWriter the way llama.cpp's converter
writes them: Qwen3 (q/k norms), Gemma 3 (norms around attention and MLP, sliding layers, linear RoPE), Phi-3 (fused
q/k/v and gate/up, longrope factor tensors) and Llama 3.1 (``rope_freqs``). Each config field is read from the right
key, each tensor lands under the right HF name with the right values (a fused tensor's row ranges, in float and from
the file's Q8_0/Q4_0 blocks), and what cannot be run as it is meant (other archs, yarn, damaged factors) is refused.
(Phi-4-mini's partial rotary, SmolLM3's NoPE layers, Granite and OLMo 2: test_families_converted.py.)"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, GGUFWriter

from quickdraft.config import RopeScaling
from quickdraft.errors import ModelLoadError
from quickdraft.loading import load_checkpoint, resolve_model
from quickdraft.loading.gguf import hf_tensor_types
from quickdraft.loading.tensor_set import expected_shapes
from quickdraft.loading.gguf_metadata import tensor_types
from quickdraft.loading.quant_convert import Sources, gguf_int4_params

try:
    from fixtures_loading import cache_dir, one_torch_thread  # noqa: F401  (fixtures)
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import cache_dir, one_torch_thread  # noqa: F401

D, F, V, HEADS, KV_HEADS = 64, 128, 64, 4, 2
TOKENS = ["<pad>", "<eos>", "<bos>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|im_end|>"] + \
    [f"t{i}" for i in range(7, V)]
LLAMA_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
QWEN3_LAYER = {**LLAMA_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA3_LAYER = {**QWEN3_LAYER, "ffn_norm": "pre_feedforward_layernorm",  # not post_attention_layernorm as in llama
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def shapes(kind: str, hd: int, kv_heads: int = KV_HEADS) -> tuple[int, ...]:
    """The HF-layout shape of a block's tensor ``kind`` (GGUF short name) with heads of ``hd``."""
    q, kv = HEADS * hd, kv_heads * hd
    return {"attn_norm": (D,), "ffn_norm": (D,), "post_attention_norm": (D,), "post_ffw_norm": (D,),
            "attn_q_norm": (hd,), "attn_k_norm": (hd,), "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D),
            "attn_qkv": (q + 2 * kv, D), "attn_output": (D, q), "ffn_gate": (F, D), "ffn_up": (F, D),
            "ffn_down": (D, F), "ffn_up_fused": (2 * F, D)}[kind]


def tensors_of(kinds: list[str], layers: int, hd: int, rng: np.random.Generator, tied: bool = True,
               kv_heads: int = KV_HEADS) -> dict[str, np.ndarray]:
    """Random float32 tensors by GGUF name: the globals and ``kinds`` in every block (1 + noise for norms)."""
    out = {"token_embd.weight": rng.standard_normal((V, D)).astype(np.float32),
           "output_norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if not tied:
        out["output.weight"] = rng.standard_normal((V, D)).astype(np.float32)
    for i in range(layers):
        for kind in kinds:
            shape = shapes(kind, hd, kv_heads)
            w = rng.standard_normal(shape).astype(np.float32) * (0.1 if len(shape) == 1 else 1.0)
            out[f"blk.{i}.{kind.removesuffix('_fused')}.weight"] = w + (1 if len(shape) == 1 else 0)
    return out


def write(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, np.ndarray],
          qtype: QT = QT.F32) -> dict[str, np.ndarray]:
    """A GGUF of ``arch`` with the base metadata, ``meta`` (``{arch}`` in a key is the arch) and ``tensors``, 2-D
    ones stored as ``qtype``; returns what each tensor holds as the file's type decodes it (by GGUF name), and the
    stored bytes under ``name + ':raw'``."""
    w = GGUFWriter(str(path), arch)
    base = {"{arch}.block_count": 2, "{arch}.context_length": 256, "{arch}.embedding_length": D,
            "{arch}.feed_forward_length": F, "{arch}.attention.head_count": HEADS,
            "{arch}.attention.head_count_kv": KV_HEADS, "{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            "{arch}.rope.freq_base": 10000.0}
    for key, value in {**base, **meta}.items():
        key = key.replace("{arch}", arch)
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    decoded: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if t.ndim == 2 and qtype != QT.F32:
            raw = gguf.quants.quantize(t, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            decoded[name] = gguf.quants.dequantize(raw, qtype).reshape(t.shape)
            decoded[name + ":raw"] = raw
        else:
            w.add_tensor(name, t)
            decoded[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def assert_mapped(ckpt: Any, decoded: dict[str, np.ndarray], layer_names: dict[str, str], layers: int) -> None:
    """Every block tensor is under its HF name with the file's values; the set is exactly what the config needs."""
    for i in range(layers):
        for kind, hf in layer_names.items():
            got = ckpt.tensors[f"model.layers.{i}.{hf}.weight"]
            np.testing.assert_array_equal(got.numpy(), decoded[f"blk.{i}.{kind}.weight"], err_msg=f"{kind} -> {hf}")
    np.testing.assert_array_equal(ckpt.tensors["model.embed_tokens.weight"].numpy(), decoded["token_embd.weight"])
    assert set(ckpt.tensors) == set(expected_shapes(ckpt.config)) | {"lm_head.weight"}
    assert ckpt.tensor_types == hf_tensor_types(tensor_types(ckpt.source))


# ---- Qwen3 --------------------------------------------------------------------------------------------------
def test_qwen3_reads_qk_norms_unpermuted(tmp_path, cache_dir):
    path = tmp_path / "qwen3.gguf"
    hd = 32  # Qwen3 sets its head size apart from hidden/heads
    decoded = write(path, "qwen3", {"{arch}.attention.key_length": hd, "{arch}.attention.value_length": hd},
                    tensors_of(list(QWEN3_LAYER), 2, hd, np.random.default_rng(0)))
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.sandwich_norms, cfg.attention_bias) == \
        ("qwen3", hd, True, False, False)
    assert cfg.hidden_act == "silu" and cfg.rope_scaling is None and cfg.eos_token_ids == (1, 6, 5)
    assert expected_shapes(cfg)["model.layers.1.self_attn.k_norm.weight"] == (hd,)
    assert_mapped(ckpt, decoded, QWEN3_LAYER, 2)  # q/k rows as stored: qwen3 is not permuted


def test_a_qwen3_file_labelled_llama_is_refused(tmp_path, cache_dir):
    """Run as llama it would skip its q/k norms and write nonsense: a mapped tensor the arch has no use for is refused."""
    path = tmp_path / "mislabelled.gguf"
    write(path, "llama", {}, tensors_of(list(QWEN3_LAYER), 2, 16, np.random.default_rng(0)))
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_k_norm\.weight is not part of a 'llama' model "
                                             r"\(4 such tensors\); is general.architecture right\?"):
        load_checkpoint(path)


def test_qwen3_without_its_qk_norms_is_refused(tmp_path, cache_dir):
    path = tmp_path / "qwen3.gguf"
    tensors = tensors_of(list(QWEN3_LAYER), 2, 16, np.random.default_rng(0))
    del tensors["blk.1.attn_k_norm.weight"]
    write(path, "qwen3", {}, tensors)
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_checkpoint(path)


# ---- Gemma 3 ------------------------------------------------------------------------------------------------
GEMMA3_META = {"{arch}.block_count": 7, "{arch}.attention.key_length": 32, "{arch}.attention.value_length": 32,
               "{arch}.attention.head_count_kv": 1, "{arch}.rope.freq_base": 1e6,
               "{arch}.attention.sliding_window": 16, "{arch}.attention.layer_norm_rms_epsilon": 1e-6}


def test_gemma3_config_and_norm_names(tmp_path, cache_dir):
    path = tmp_path / "gemma3.gguf"
    decoded = write(path, "gemma3", {**GEMMA3_META, "{arch}.rope.scaling.type": "linear",
                                     "{arch}.rope.scaling.factor": 8.0},
                    tensors_of(list(GEMMA3_LAYER), 7, 32, np.random.default_rng(1), kv_heads=1))
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (7, 4, 1, 32)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.embedding_multiplier == math.sqrt(D) and cfg.query_pre_attn_scalar == 32  # key_length, not D/heads
    assert cfg.attention_scale == 32 ** -0.5
    assert cfg.sliding_window == 16 and cfg.rope_theta == 1e6 and cfg.local_rope_theta == 10000.0
    assert [i for i in range(7) if not cfg.is_sliding(i)] == [5]  # every 6th layer is full
    assert cfg.rope_scaling == RopeScaling("linear", factor=8.0)  # of the full layers
    assert cfg.eos_token_ids == (1, 6, 3)  # <eos>, <|im_end|> (this made-up vocabulary has it), <end_of_turn>
    assert_mapped(ckpt, decoded, GEMMA3_LAYER, 7)
    # the second load reads the header record: the same config, RoPE scaling and layer types included
    assert load_checkpoint(path).config == cfg


def test_gemma3_without_a_window_is_all_full_layers(tmp_path, cache_dir):
    path = tmp_path / "gemma3.gguf"
    write(path, "gemma3", {**GEMMA3_META, "{arch}.attention.sliding_window": None, "{arch}.block_count": 2},
          tensors_of(list(GEMMA3_LAYER), 2, 32, np.random.default_rng(1), kv_heads=1))
    cfg = load_checkpoint(path).config
    assert cfg.sliding_window is None and cfg.layer_types == () and cfg.local_rope_theta is None
    assert not any(cfg.is_sliding(i) for i in range(2)) and cfg.rope_scaling is None


@pytest.mark.parametrize("meta,expected", [
    ({"{arch}.final_logit_softcapping": 30.0}, 30.0),  # llama.cpp caps the logits where the key is set
    ({"{arch}.final_logit_softcapping": 0.0}, None),  # 0: none, as llama.cpp reads it
    ({"{arch}.final_logit_softcapping": float("nan")}, r"'gemma3.final_logit_softcapping' is float nan; it must be"),
    ({"{arch}.attn_logit_softcapping": 50.0}, None),  # ignored, as llama.cpp and transformers ignore it
])
def test_gemma3_soft_caps_as_llama_cpp_reads_them(tmp_path, cache_dir, meta, expected):
    path = tmp_path / "gemma3.gguf"
    write(path, "gemma3", {**GEMMA3_META, "{arch}.block_count": 2, **meta},
          tensors_of(list(GEMMA3_LAYER), 2, 32, np.random.default_rng(1), kv_heads=1))
    if isinstance(expected, str):
        with pytest.raises(ModelLoadError, match=expected):
            load_checkpoint(path)
        return
    cfg = load_checkpoint(path).config
    assert cfg.final_logit_softcapping == expected and cfg.attn_logit_softcapping is None


def test_real_gemma3_270m_config(cache_dir):
    """The packaged Gemma 3 270M Q4_K_M: assembled from its four part packages, its config as transformers' has it."""
    try:
        path = resolve_model("gemma3-270m")
    except ModelLoadError as exc:
        pytest.skip(f"Gemma 3 270M is not installed (make models-gemma): {exc}")
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("gemma3", 262144, 640, 2048)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.sliding_window == 512 and [i for i in range(18) if not cfg.is_sliding(i)] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 10000.0, None)
    assert cfg.query_pre_attn_scalar == 256 and cfg.max_position_embeddings == 32768
    assert math.isclose(cfg.rms_norm_eps, 1e-6, rel_tol=1e-6) and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 2 and cfg.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    assert ckpt.quantization == "Q4_K_M" and len(ckpt.tensors) == 18 * 13 + 3
    norm = ckpt.tensors["model.layers.0.pre_feedforward_layernorm.weight"]
    assert norm.shape == (640,) and float(norm.mean()) > 0.5  # stored as 1 + w


# ---- Phi-3 --------------------------------------------------------------------------------------------------
PHI3_LAYER = ["attn_norm", "ffn_norm", "attn_qkv", "attn_output", "ffn_up_fused", "ffn_down"]


def phi3_meta(**extra: Any) -> dict[str, Any]:
    return {"{arch}.context_length": 1024, "{arch}.rope.dimension_count": 16,
            "{arch}.rope.scaling.original_context_length": 128, "{arch}.attention.sliding_window": 2047, **extra}


def phi3_factors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"rope_factors_long.weight": (1 + 9 * rng.random(8)).astype(np.float32),
            "rope_factors_short.weight": (1 + rng.random(8)).astype(np.float32)}


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
def test_phi3_fused_tensors_split_into_row_ranges(tmp_path, cache_dir, qtype):
    path = tmp_path / "phi3.gguf"
    rng = np.random.default_rng(2)
    factors = phi3_factors(rng)
    tensors = {**tensors_of(PHI3_LAYER, 2, 16, rng, tied=False), **factors}
    decoded = write(path, "phi3", phi3_meta(**{"{arch}.rope.scaling.attn_factor": 1.25}), tensors, qtype)
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert cfg.architecture == "phi3" and cfg.head_dim == 16 and not cfg.tie_word_embeddings
    assert cfg.sliding_window is None  # llama.cpp ignores phi3's window too
    assert cfg.rope_scaling == RopeScaling(
        "longrope", short_factor=tuple(float(x) for x in factors["rope_factors_short.weight"]),
        long_factor=tuple(float(x) for x in factors["rope_factors_long.weight"]),
        original_max_position_embeddings=128, attention_factor=1.25, factor=1024 / 128)
    q, kv = HEADS * 16, KV_HEADS * 16
    parts = {"self_attn.q_proj": ("attn_qkv", 0, q), "self_attn.k_proj": ("attn_qkv", q, q + kv),
             "self_attn.v_proj": ("attn_qkv", q + kv, q + 2 * kv), "mlp.gate_proj": ("ffn_up", 0, F),
             "mlp.up_proj": ("ffn_up", F, 2 * F)}
    for i in range(2):
        for hf, (kind, r0, r1) in parts.items():
            name, fused = f"model.layers.{i}.{hf}.weight", f"blk.{i}.{kind}.weight"
            np.testing.assert_array_equal(ckpt.tensors[name].numpy(), decoded[fused][r0:r1], err_msg=name)
            assert ckpt.tensor_types[name] == qtype.name and ckpt.block_types[name] == qtype
            if qtype != QT.F32:  # the stored blocks of exactly these rows
                assert np.asarray(ckpt.blocks[name]).tobytes() == decoded[fused + ":raw"][r0:r1].tobytes()
    assert_mapped(ckpt, decoded, {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                                  "attn_output": "self_attn.o_proj", "ffn_down": "mlp.down_proj"}, 2)
    assert "rope_factors_long.weight" not in ckpt.tensors and load_checkpoint(path).config == cfg


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
def test_phi3_fused_rows_reach_the_quantized_conversion(tmp_path, cache_dir, qtype):
    """What the int4/int8 conversion reads (``quant_convert.Sources``): a fused tensor's row range from the file's
    blocks, a block of its rows at a time, and for Q4_0 the exact int4 mapping of those rows."""
    path = tmp_path / "phi3.gguf"
    rng = np.random.default_rng(3)
    decoded = write(path, "phi3", phi3_meta(), tensors_of(PHI3_LAYER, 2, 16, rng), qtype)
    ckpt = load_checkpoint(path)
    cfg, sources = ckpt.config, Sources.of(ckpt)
    q, kv = HEADS * 16, KV_HEADS * 16
    whole = decoded["blk.1.attn_qkv.weight:raw"]
    for hf, r0, r1 in (("self_attn.k_proj", q, q + kv), ("self_attn.v_proj", q + kv, q + 2 * kv)):
        name = f"model.layers.1.{hf}"
        linear = torch.nn.Linear(D, r1 - r0, bias=False, device="meta")
        assert sources.reads_rows(name, cfg)
        got = sources.float32(name, linear, cfg, (3, 9))
        np.testing.assert_array_equal(got.numpy(), decoded["blk.1.attn_qkv.weight"][r0 + 3:r0 + 9])
        if qtype == QT.Q4_0:
            *mapped, exact = sources.int4(name, linear, cfg, 32)
            reference = gguf_int4_params(whole, qtype, whole.shape[:1] + (D,))
            assert exact
            for got_t, ref_t in zip(mapped, reference):
                torch.testing.assert_close(got_t, ref_t[r0:r1], rtol=0, atol=0)
    linear = torch.nn.Linear(D, F, bias=False, device="meta")
    np.testing.assert_array_equal(sources.float32("model.layers.0.mlp.up_proj", linear, cfg).numpy(),
                                  decoded["blk.0.ffn_up.weight"][F:])


def test_phi3_q4_0_model_maps_every_linear_exactly_to_int4(tmp_path, cache_dir):
    """``load_model``'s int4 conversion (through its cache) takes each q/k/v and gate/up row range straight from the
    fused Q4_0 blocks: all 7 linears of both layers are exact GGUF int4."""
    from quickdraft.loading.quantize import load_model

    path = tmp_path / "phi3.gguf"
    rng = np.random.default_rng(3)
    write(path, "phi3", phi3_meta(), {**tensors_of(PHI3_LAYER, 2, 16, rng), **phi3_factors(rng)}, QT.Q4_0)
    info = load_model(load_checkpoint(path), "int4").quant_info
    assert info["exact_from_file"] == 14 and info["kernels"] == {"int4": {"Q4_0": 14}, "int8": {"Q4_0 lm_head": 1}}


def test_phi3_attention_factor_defaults_as_transformers_computes_it(tmp_path, cache_dir):
    path = tmp_path / "phi3.gguf"
    rng = np.random.default_rng(4)
    write(path, "phi3", phi3_meta(), {**tensors_of(PHI3_LAYER, 2, 16, rng), **phi3_factors(rng)})
    scaling = load_checkpoint(path).config.rope_scaling
    assert scaling.type == "longrope" and scaling.original_max_position_embeddings == 128
    assert scaling.attention_factor is None and math.isclose(scaling.attention, math.sqrt(1 + math.log(1024 / 128) / math.log(128)))


@pytest.mark.parametrize("case,message", [
    ("one factor tensor", r"has rope_factors_long.weight but not rope_factors_short.weight; longrope needs both"),
    ("partial rotary", r"tensor rope_factors_short.weight has shape \(8,\); RoPE over 12 dims of a head needs \(6,\)"),
    ("qkv rows", r"tensor blk.0.attn_qkv.weight has shape \(127, 64\); the model config needs 64 \+ 32 \+ 32 = 128"),
    ("no original context", r"missing 'phi3.rope.scaling.original_context_length'"),
])
def test_phi3_damage_is_refused(tmp_path, cache_dir, case, message):
    path = tmp_path / "phi3.gguf"
    rng = np.random.default_rng(5)
    tensors = {**tensors_of(PHI3_LAYER, 2, 16, rng), **phi3_factors(rng)}
    meta = phi3_meta()
    if case == "one factor tensor":
        del tensors["rope_factors_short.weight"]
    elif case == "partial rotary":
        meta["{arch}.rope.dimension_count"] = 12
    elif case == "qkv rows":
        tensors["blk.0.attn_qkv.weight"] = tensors["blk.0.attn_qkv.weight"][:127]
    else:
        meta["{arch}.rope.scaling.original_context_length"] = None
    write(path, "phi3", meta, tensors)
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path)


# ---- Llama 3.1 rope_freqs and RoPE scaling keys -------------------------------------------------------------
def llama(path: Path, meta: dict[str, Any], freqs: np.ndarray | None = None) -> None:
    tensors = tensors_of(list(LLAMA_LAYER), 2, 16, np.random.default_rng(6))
    if freqs is not None:
        tensors["rope_freqs.weight"] = freqs
    write(path, "llama", meta, tensors)


def test_llama_rope_freqs_become_per_frequency_factors(tmp_path, cache_dir):
    path = tmp_path / "llama31.gguf"
    freqs = np.array([1, 1, 1.5, 2, 4, 8, 8, 8], dtype=np.float32)
    llama(path, {"{arch}.context_length": 512}, freqs)
    ckpt = load_checkpoint(path)
    assert ckpt.config.rope_scaling == RopeScaling("longrope", short_factor=tuple(map(float, freqs)),
                                                   long_factor=tuple(map(float, freqs)),
                                                   original_max_position_embeddings=512, attention_factor=1.0)
    assert "rope_freqs.weight" not in ckpt.tensors
    assert load_checkpoint(path).config == ckpt.config  # from the header record


@pytest.mark.parametrize("meta,expected", [
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}, RopeScaling("linear", factor=4.0)),
    ({"{arch}.rope.scaling.factor": 2.0}, RopeScaling("linear", factor=2.0)),  # llama.cpp's default type: linear
    ({"{arch}.rope.scale_linear": 2.0}, RopeScaling("linear", factor=2.0)),  # the older key
    ({"{arch}.rope.scaling.type": "none", "{arch}.rope.scaling.factor": 4.0}, None),  # none never scales
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 1.0}, None),
    ({"{arch}.rope.scaling.type": "none"}, None),
], ids=["linear", "factor only", "scale_linear", "none", "factor 1", "none alone"])
def test_rope_scaling_keys(tmp_path, cache_dir, meta, expected):
    path = tmp_path / "llama.gguf"
    llama(path, meta)
    assert load_checkpoint(path).config.rope_scaling == expected


@pytest.mark.parametrize("meta,freqs,message", [
    ({"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0}, None,
     r"RoPE scaling str 'yarn' \(llama.rope.scaling.type\) is not supported; supported: none, linear"),
    ({"{arch}.rope.scaling.type": "longrope"}, None, r"RoPE scaling str 'longrope' .* is not supported"),
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}, np.ones(8, np.float32),
     r"both linear RoPE scaling \(llama.rope.scaling.factor=4.0\) and per-frequency factors"),
    ({"{arch}.rope.scaling.factor": -2.0}, None, r"'llama.rope.scaling.factor' is float -2.0; it must be a positive"),
], ids=["yarn", "longrope key", "linear and rope_freqs", "negative factor"])
def test_unsupported_rope_scaling_is_refused(tmp_path, cache_dir, meta, freqs, message):
    path = tmp_path / "llama.gguf"
    llama(path, meta, freqs)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


# ---- other architectures ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["falcon", "gemma", "phi2"])
def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path, cache_dir, arch):
    path = tmp_path / f"{arch}.gguf"
    write(path, arch, {}, tensors_of(list(LLAMA_LAYER), 2, 16, np.random.default_rng(7)))
    with pytest.raises(ModelLoadError) as err:
        load_checkpoint(path)
    assert f"unsupported architecture '{arch}'; supported: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3" in str(err.value)


def test_mistral_arch_is_read_like_llama(tmp_path, cache_dir):
    """llama.cpp writes Mistral GGUFs as 'llama'; a file that says 'mistral' is read the same way (q/k permuted)."""
    paths = {arch: tmp_path / f"{arch}.gguf" for arch in ("llama", "mistral")}
    for arch, path in paths.items():
        write(path, arch, {}, tensors_of(list(LLAMA_LAYER), 2, 16, np.random.default_rng(8)))
    a, b = (load_checkpoint(p) for p in paths.values())
    assert dataclasses.replace(a.config, architecture="mistral") == b.config
    for name in a.tensors:
        torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=0)
