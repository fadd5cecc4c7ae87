"""Families from GGUF files as llama.cpp's converter writes them, made here from test_families.py's HF checkpoints: RoPE
over part of each head (Phi-4-mini), layers without RoPE (SmolLM3), Granite's multipliers, OLMo 2's norms after its
blocks alone and its whole-q/k norms, Gemma 2's soft-capped scores and logits. transformers' logits and greedy tokens
from the file, the file's quantized blocks keeping greedy output, llama.cpp itself reading the same file as we do (where
llama-cpp-python is installed), and damaged keys refused."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from quickdraft import LLM, SamplingParams
from quickdraft.errors import ModelLoadError
from test_families import TOLERANCE, family_dir, hf_greedy, prompt  # noqa: F401 (a fixture)
from test_moe import add_model_keys, add_word_tokenizer, llama_permute
from test_parity import our_logits

LLAMA_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
PHI3_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
              "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
OLMO2_LAYER = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GEMMA2_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                **{hf: kind for hf, kind in LLAMA_LAYER.items() if "norm" not in hf}}
ARCH = {"smollm3": "smollm3", "phi4-mini-partial": "phi3", "granite": "granite", "olmo2": "olmo2", "gemma2": "gemma2"}
LAYERS = {"smollm3": LLAMA_LAYER, "phi4-mini-partial": PHI3_LAYER, "granite": LLAMA_LAYER, "olmo2": OLMO2_LAYER,
          "gemma2": GEMMA2_LAYER}


def write_gguf(path: Path, hf_path: Path, name: str, qtype=None, rotary: int | None = None,
               original: int | None = None, keys: dict | None = None, extra=None) -> Path:
    """``hf_path``'s checkpoint as llama.cpp's converter writes it: SmolLM3 and Granite as Llama (q/k rows permuted;
    no key for SmolLM3's NoPE layers, Granite's multipliers as ``*_scale`` keys), Phi-4-mini as phi3 (fused q/k/v and
    gate/up, ``rope.dimension_count`` its rotated dims or ``rotary``, the longrope factors, their original context or
    ``original``, and the attention factor the converter computes, a tied head), OLMo 2 as its converter writes it
    (rows as they are, norms after the blocks alone), Gemma 2 as its converter writes it (norms stored as 1 + w, both
    soft-caps and the window as keys, a tied head); 2-D weights in ``qtype`` (default float32). ``keys``: Granite's
    and Gemma 2's keys written over the converter's (a float as float32, an int as uint32 or int32, a string, a list as an array,
    None: left out); ``extra(writer)``: keys the converter does not write (a damaged file's,
    or another release's)."""
    import gguf.quants
    from gguf import GGUFWriter

    cfg = json.loads((hf_path / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])  # (Granite's config has none)
    state = load_file(hf_path / "model.safetensors")
    w = GGUFWriter(str(path), ARCH[name])
    add_model_keys(w, cfg)
    add_word_tokenizer(w, cfg["vocab_size"])
    rope = cfg["rope_parameters"]
    if name == "phi4-mini-partial":
        dims = int(rope["partial_rotary_factor"] * cfg["hidden_size"]) // cfg["num_attention_heads"]
        original = original or rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_dimension_count(dims if rotary is None else rotary)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    given = {}
    if name == "granite":
        given = {"granite.embedding_scale": cfg["embedding_multiplier"],
                 "granite.attention.scale": cfg["attention_multiplier"],
                 "granite.residual_scale": cfg["residual_multiplier"], "granite.logit_scale": cfg["logits_scaling"]}
    if name == "gemma2":
        given = {"gemma2.attn_logit_softcapping": float(cfg["attn_logit_softcapping"]),
                 "gemma2.final_logit_softcapping": float(cfg["final_logit_softcapping"]),
                 "gemma2.attention.sliding_window": int(cfg["sliding_window"])}
    for key, value in {**given, **(keys or {})}.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            (w.add_uint32 if value >= 0 else w.add_int32)(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value is not None:
            w.add_array(key, value)
    if extra is not None:
        extra(w)

    def add(gguf_name: str, t: torch.Tensor) -> None:
        t = t.float().contiguous().numpy()
        if qtype is not None and t.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, t)

    offset = 1.0 if name == "gemma2" else 0.0  # Gemma's converter stores its norms as 1 + w

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"] + offset)
    if "lm_head.weight" in state:
        add("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, kind in LAYERS[name].items():
            t = state[f"model.layers.{i}.{hf}.weight"]
            if hf.endswith("layernorm"):
                t = t + offset
            if kind in ("attn_q", "attn_k") and ARCH[name] in ("smollm3", "granite"):  # the converter's Llama order
                t = llama_permute(t, cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
            add(f"blk.{i}.{kind}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", list(ARCH))
def test_gguf_matches_transformers(family_dir, tmp_path, name):
    """A float32 file: transformers' logits within float32 rounding, and its greedy tokens."""
    hf_path, hf = family_dir(name)
    llm = LLM(str(write_gguf(tmp_path / "m.gguf", hf_path, name)), dtype="float32", weights="float32",
              kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert (cfg.architecture, cfg.unrotated_layers, cfg.rotary_dim) == {
        "smollm3": ("smollm3", (3,), None), "phi4-mini-partial": ("phi3", (), 12), "granite": ("granite", (), None),
        "olmo2": ("olmo2", (), None), "gemma2": ("gemma2", (), None)}[name]
    if name == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.sliding_window) == (
            pytest.approx(0.05), 6.0, 12)
        assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    if name == "olmo2":
        assert not cfg.pre_norms and cfg.sandwich_norms and cfg.qk_norm and not cfg.qk_norm_per_head
    if name == "phi4-mini-partial":
        assert cfg.rope_scaling.type == "longrope" and len(cfg.rope_scaling.short_factor) == 6
    if name == "granite":
        assert (cfg.embedding_multiplier, cfg.attention_scale, cfg.residual_multiplier, cfg.logits_scaling) == (
            12.0, 0.0390625, pytest.approx(0.22), 0.125)
    ids = prompt(30)  # within the original context of the longrope factors (see test_families.py)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (our_logits(llm, ids) - ref).abs().max().item() < TOLERANCE
    start = prompt(8, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert llm.generate([start], params)[0].token_ids == hf_greedy(hf, start, 20)


@pytest.mark.parametrize("name", list(ARCH))
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_the_files_own_blocks_keep_greedy_output(family_dir, tmp_path, name, qtype):
    """The file's own quantized blocks on the fused C layers: a batch equals each prompt alone, and the model drafting
    for itself (n-gram, its own layers) keeps every greedy token."""
    from gguf import GGMLQuantizationType as QT

    path = str(write_gguf(tmp_path / "m.gguf", family_dir(name)[0], name, QT[qtype]))
    prompts = [prompt(n, seed=n) for n in (5, 27)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(path, kv_cache_memory="16MiB")
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    for spec in (dict(speculative="ngram"), dict(speculative="self")):
        drafted = LLM(path, kv_cache_memory="16MiB", num_speculative_tokens=3, **spec)
        assert [o.token_ids for o in drafted.generate(prompts, params)] == alone, spec


@pytest.mark.parametrize("rotary,message", [
    (10, r"tensor rope_factors_short.weight has shape \(6,\); RoPE over 10 dims of a head needs \(5,\), one factor "
         r"per frequency"),
    (7, r"'phi3.rope.dimension_count' is 7; allowed: an even number of dims in 2 to the head dimension 16"),
    (0, r"'phi3.rope.dimension_count' is 0; allowed: an even number"),
])
def test_damaged_rotary_dims_are_refused(family_dir, tmp_path, rotary, message):
    path = write_gguf(tmp_path / "m.gguf", family_dir("phi4-mini-partial")[0], "phi4-mini-partial", rotary=rotary)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("keys,message", [
    ({"granite.residual_scale": 1e30}, r"'granite.residual_scale' is 1e\+30; allowed: 0.001 to 1e\+09"),
    ({"granite.attention.scale": float("nan")}, r"'granite.attention.scale' is float nan; it must be a positive"),
    ({"granite.logit_scale": -8.0}, r"'granite.logit_scale' is float -8.0; it must be a positive"),
    ({"granite.attention.scale": 1e4}, r"'granite.attention.scale' is 10000; allowed: 1e-06 to 1000"),
])
def test_damaged_granite_keys_are_refused_by_name(family_dir, tmp_path, keys, message):
    path = write_gguf(tmp_path / "damaged.gguf", family_dir("granite")[0], "granite", keys=keys)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("keys,message", [
    ({"gemma2.attn_logit_softcapping": float("nan")}, r"'gemma2.attn_logit_softcapping' is float nan; it must be a "
                                                      r"positive finite number"),
    ({"gemma2.final_logit_softcapping": -1.0}, r"'gemma2.final_logit_softcapping' is float -1.0; it must be a "
                                               r"positive"),
    ({"gemma2.attn_logit_softcapping": 1e30}, r"'gemma2.attn_logit_softcapping' is 1e\+30; allowed: 0.001 to 1e\+09"),
    ({"gemma2.attention.sliding_window": 0}, r"'gemma2.attention.sliding_window' is 0; allowed: 1 to 16,777,216"),
    ({"gemma2.attention.sliding_window_pattern": [True, False]},
     r"'gemma2.attention.sliding_window_pattern' is list \[True, False\]; as a list it must hold a flag \(true/false, "
     r"1/0\) for each of the 3 layers"),
    ({"gemma2.attention.sliding_window_pattern": [1, 2, 0]}, r"'gemma2.attention.sliding_window_pattern' is list"),
    ({"gemma2.attention.sliding_window_pattern": -2}, r"'gemma2.attention.sliding_window_pattern' is -2; allowed: 0"),
    ({"gemma2.rope.freq_base_swa": 1e20}, r"'gemma2.rope.freq_base_swa' is 1[.\d]*e\+20; allowed: above 1 up to "
                                          r"1e\+12"),
    ({"gemma2.rope.freq_base_swa": 1e5, "gemma2.rope.scaling.type": "linear", "gemma2.rope.scaling.factor": 2.0},
     r"'gemma2.rope.freq_base_swa' with RoPE scaling is not supported"),
])
def test_damaged_gemma2_keys_are_refused_by_name(family_dir, tmp_path, keys, message):
    path = write_gguf(tmp_path / "damaged.gguf", family_dir("gemma2")[0], "gemma2", keys=keys)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("keys,sliding,caps", [
    ({}, ["sliding_attention", "full_attention", "sliding_attention"], (0.05, 6.0)),
    # llama.cpp's defaults where the converter's keys are absent: caps of 50 and 30, a window of 4096
    ({"gemma2.attn_logit_softcapping": None, "gemma2.final_logit_softcapping": None,
      "gemma2.attention.sliding_window": None}, ["sliding_attention", "full_attention", "sliding_attention"],
     (50.0, 30.0)),
    ({"gemma2.attention.sliding_window_pattern": 0}, ["sliding_attention"] * 3, (0.05, 6.0)),
    ({"gemma2.attention.sliding_window_pattern": 3}, ["sliding_attention", "sliding_attention", "full_attention"],
     (0.05, 6.0)),
    ({"gemma2.attention.sliding_window_pattern": [False, True, True]},
     ["full_attention", "sliding_attention", "sliding_attention"], (0.05, 6.0)),
    ({"gemma2.attention.sliding_window_pattern": [1, 1, 0], "gemma2.final_logit_softcapping": 0.0},  # 0: no cap
     ["sliding_attention", "sliding_attention", "full_attention"], (0.05, None)),
])
def test_gemma2_keys_as_llama_cpp_reads_them(family_dir, tmp_path, keys, sliding, caps):
    """Which layers slide (``sliding_window_pattern``: every n-th layer full, 0 none, or a flag per layer), and the
    defaults where a key is absent."""
    path = write_gguf(tmp_path / "m.gguf", family_dir("gemma2")[0], "gemma2", keys=keys)
    cfg = LLM(str(path), dtype="float32", kv_cache_memory="16MiB").model.config
    assert list(cfg.layer_types) == sliding
    for got, want in zip((cfg.attn_logit_softcapping, cfg.final_logit_softcapping), caps):
        assert got == (None if want is None else pytest.approx(want))
    assert cfg.sliding_window == (4096 if "gemma2.attention.sliding_window" in keys else 12)


def test_an_olmo3_window_is_refused(family_dir, tmp_path):
    """OLMo 3 files are olmo2 files with a sliding window on 3 of every 4 layers: refused, not run without it."""
    path = write_gguf(tmp_path / "olmo3.gguf", family_dir("olmo2")[0], "olmo2",
                      extra=lambda w: w.add_sliding_window(4096))
    with pytest.raises(ModelLoadError, match=r"'olmo2.attention.sliding_window' is int 4096: OLMo 3's sliding layers "
                                             r"are not supported yet"):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


def test_part_of_a_head_outside_phi3_is_refused(family_dir, tmp_path):
    """llama.cpp rotates Llama-layout files' pairs over the permuted rows: RoPE over part of their heads is not the
    NeoX rotation of the first dims, so it is refused rather than run as something else."""
    path = write_gguf(tmp_path / "partial.gguf", family_dir("smollm3")[0], "smollm3",
                      extra=lambda w: w.add_rope_dimension_count(8))
    with pytest.raises(ModelLoadError, match=r"'smollm3.rope.dimension_count' is 8 but the head dimension is 16; RoPE "
                                             r"over part of a head is supported for phi3 only"):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("name,rotates", [(name, True) for name in ARCH] + [("granite", False)])
def test_llama_cpp_reads_the_gguf_as_we_do(family_dir, tmp_path, name, rotates):
    """The real peer on the same file (where llama-cpp-python is installed): its logits are ours within float32
    rounding (1e-5 of the largest; rotating SmolLM3's NoPE layer moves them by 5e-4 of it), every position's argmax
    the same: NoPE layers, RoPE over part of each head, Granite's multipliers, OLMo 2's norms and Gemma 2's caps and
    window are where llama.cpp puts them; a Granite file whose ``rope.scaling.finetuned`` is false rotates no layer, in both."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install quickdraft[llamacpp])")
    from llama_cpp import Llama

    # llama.cpp picks longrope's short or long factors for every position by its context (at least 256), we by each
    # position: the file's original context at 256 makes both take the short ones below it
    no_rope = None if rotates else (lambda w: w.add_bool("granite.rope.scaling.finetuned", False))
    path = write_gguf(tmp_path / "m.gguf", family_dir(name)[0], name, original=256, extra=no_rope)
    ids = prompt(30)
    llm = LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB")
    assert len(llm.model.config.unrotated_layers) == (0 if rotates else 2) or name == "smollm3"
    ours = our_logits(llm, ids)
    # its cache in float32 (type 0), as ours: its default f16 cache alone moves OLMo 2's logits by 4e-4 of the largest
    peer = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    peer.eval(ids)
    theirs = torch.tensor(np.array(peer.scores[:len(ids)]))
    # llama.cpp's CPU GELU reads a table of float16 inputs and outputs: Gemma 2's logits move by 2.6e-4 of the largest
    # (3.7e-5 where ours rounds the same way), the attention cap left out would move them by 6e-3
    tolerance = 5e-4 if name == "gemma2" else 1e-5
    assert (ours - theirs).abs().max().item() < tolerance * ours.abs().max().item()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
