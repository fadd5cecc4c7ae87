"""gpt-oss from a Hugging Face directory equals transformers on a tiny random checkpoint that transformers builds and
saves itself, in float32: its attention sinks (a learned logit per head in every softmax), alternating sliding and
full layers, YaRN RoPE, biases on q/k/v/o, the router's bias and softmax over its top-k, and the experts' clamped
SwiGLU with biases (stored stacked, transposed, gate and up interleaved). Logits, the router's choices on every token
of every layer, 48 greedy tokens, through speculation, on int8 weights and in the static step; damaged files are
refused by name. (GGUF gpt-oss and its MXFP4 experts are not supported: docs/MEASUREMENTS.md.)"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import write_word_tokenizer
from quickdraft import LLM, SamplingParams
from quickdraft.config import RopeScaling
from quickdraft.errors import ModelLoadError
from quickdraft.models.rope import rope_tables
from test_families import _edited, hf_greedy, prompt
from test_moe import add_model_keys, add_word_tokenizer, hf_router_choices, our_router_choices
from test_parity import our_logits

VOCAB = 96
WINDOW = 8
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0, "truncate": False}
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, num_hidden_layers=3, intermediate_size=32, num_local_experts=6,
              num_experts_per_tok=2, sliding_window=WINDOW, eos_token_id=0, bos_token_id=None, rope_parameters=YARN,
              swiglu_limit=0.5)  # below the tiny model's largest gate values: the clamp acts (checked below)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model", CONFIG)


@pytest.fixture(scope="module")
def gpt_oss_released_limit(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """The released models' clamp (7), which a GGUF cannot state otherwise: llama.cpp's gpt-oss has it built in."""
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss_7") / "model", {**CONFIG, "swiglu_limit": 7.0})


def make_gpt_oss(path: Path, config: dict) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).eval()
    with torch.no_grad():  # transformers' init leaves biases and sinks at 0: give them values that matter
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("bias") or "router" in name:
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return path, transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_reads_as_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    """transformers' logits within 1e-4 over a 60-token prompt (far past the window: sliding layers drop keys), its
    router choices on every token of every layer, and its 48 greedy tokens."""
    ids = prompt(60)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (our_logits(llm, ids) - ref).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff {diff}"
    theirs, ours = hf_router_choices(hf, ids), our_router_choices(llm, ids)
    assert len(ours) == len(theirs) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    start = prompt(8, seed=2)
    assert llm.generate([start], GREEDY)[0].token_ids == hf_greedy(hf, start, 48)


def test_gpt_oss_matches_transformers(gpt_oss):
    path, hf = gpt_oss
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.attention_sinks, cfg.rope_scaling.type) == ("gpt_oss", 6, True, "yarn")
    assert [cfg.window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert_reads_as_transformers(llm, hf)


def test_the_clamp_and_the_sinks_are_exercised(gpt_oss):
    """The parity above means something only if gate values reach the clamp and the sinks take mass."""
    path, hf = gpt_oss
    gates: list[torch.Tensor] = []
    experts = [m for m in hf.modules() if type(m).__name__ == "GptOssExperts"]
    hooks = [e.register_forward_hook(lambda m, inp, _: gates.append(inp[0] @ m.gate_up_proj[0][:, ::2]))
             for e in experts]
    with torch.no_grad():
        hf(torch.tensor([prompt(60)]))
    for h in hooks:
        h.remove()
    assert max(g.max().item() for g in gates) > hf.config.swiglu_limit
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    ids = prompt(20)
    with_sinks = our_logits(llm, ids)
    for layer in llm.model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: attention without sinks
    assert (our_logits(llm, ids) - with_sinks).abs().max().item() > 1e-2


def test_yarn_tables_equal_transformers():
    for truncate in (False, True):
        cfg = transformers.GptOssConfig(**{**CONFIG, "rope_parameters": {**YARN, "truncate": truncate}})
        inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        scaling = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64, truncate=truncate)
        cos, sin = rope_tables(16, 10000.0, scaling, 200)
        angles = torch.arange(200, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
        assert scaling.attention == pytest.approx(attention)
        torch.testing.assert_close(cos.double(), angles.cos() * attention, rtol=0, atol=1e-5)
        torch.testing.assert_close(sin.double(), angles.sin() * attention, rtol=0, atol=1e-5)


@pytest.mark.parametrize("options", [dict(speculative="ngram", num_speculative_tokens=3),
                                     dict(speculative="self", num_speculative_tokens=3),
                                     dict(static_step="eager"),
                                     dict(weights="int8", speculative="ngram", num_speculative_tokens=3)])
def test_every_path_keeps_greedy_output(gpt_oss, options):
    """Speculation (rejections included), the graph-ready static step (its paged attention with the sinks) and
    quantized experts with biases: each gives the plain run's greedy tokens of the same weights, in a batch."""
    path, _ = gpt_oss
    prompts = [prompt(8, seed=s) for s in (2, 3, 4)] + [prompt(4, seed=5) * 5]  # the last one repeats itself
    weights = options.get("weights", "float32")
    plain = LLM(str(path), dtype="float32", weights=weights, kv_cache_memory="16MiB")
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", **options)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    if "speculative" in options:
        stats = llm.spec_stats
        assert stats.draft_tokens > 0
        if options["speculative"] == "ngram":  # drafts from the repeating prompt: accepted and rejected ones
            assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("changes, message", [
    ({"swiglu_limit": float("nan")}, r"swiglu_limit=nan; allowed"),
    ({"swiglu_alpha": -1.0}, r"swiglu_alpha=-1.0; allowed"),
    ({"num_local_experts": 5}, r"mlp\.experts\.\w+ has shape \[6, \d+, \d+\]; the config needs \[5, \d+, \d+\]"),
    ({"intermediate_size": 16}, r"mlp\.experts\.(gate_up|down)_proj has shape \[6, (64, 64|32, 64)\]; the config needs"),
    ({"num_attention_heads": 8, "hidden_size": 64, "head_dim": 8},
     r"tensor model\.layers\.0\.self_attn\.\w+\.weight has shape"),
])
def test_damaged_configs_are_refused_by_name(gpt_oss, tmp_path, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(_edited(tmp_path, gpt_oss[0], **changes)), dtype="float32", kv_cache_memory="16MiB")


def test_a_missing_sink_is_refused(gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    target = _edited(tmp_path, gpt_oss[0])
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.1\.self_attn\.sinks"):
        LLM(str(target), dtype="float32", kv_cache_memory="16MiB")
    assert json.loads((target / "config.json").read_text())["model_type"] == "gpt_oss"


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def write_gpt_oss_gguf(path: Path, hf_path: Path, experts_type=None) -> Path:
    """The checkpoint as llama.cpp's converter writes gpt-oss: gate and up de-interleaved into stacks of [E, I, H]
    (down [E, H, I]) with stacked biases, sinks as ``attn_sinks.weight``, the YaRN and window keys; the experts in
    ``experts_type`` (e.g. MXFP4, as the released files; default float32), everything else float32."""
    import gguf.quants
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((hf_path / "config.json").read_text())
    state = load_file(hf_path / "model.safetensors")
    w = GGUFWriter(str(path), "gpt-oss")
    add_model_keys(w, cfg)
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg["rope_parameters"]["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg["rope_parameters"]["original_max_position_embeddings"])
    add_word_tokenizer(w, VOCAB)

    def add(name: str, t: torch.Tensor, qtype=None) -> None:
        t = t.float().contiguous().numpy()
        if qtype is None:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, kind in GGUF_LAYER.items():
            for leaf in ("weight", "bias"):
                if f"{p}{hf}.{leaf}" in state:
                    add(f"blk.{i}.{kind}.{leaf}", state[f"{p}{hf}.{leaf}"])
        add(f"blk.{i}.attn_sinks.weight", state[f"{p}self_attn.sinks"])
        gate_up, gate_up_bias = state[f"{p}mlp.experts.gate_up_proj"], state[f"{p}mlp.experts.gate_up_proj_bias"]
        add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :, 0::2].transpose(1, 2), experts_type)
        add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, :, 1::2].transpose(1, 2), experts_type)
        add(f"blk.{i}.ffn_down_exps.weight", state[f"{p}mlp.experts.down_proj"].transpose(1, 2), experts_type)
        add(f"blk.{i}.ffn_gate_exps.bias", gate_up_bias[:, 0::2])
        add(f"blk.{i}.ffn_up_exps.bias", gate_up_bias[:, 1::2])
        add(f"blk.{i}.ffn_down_exps.bias", state[f"{p}mlp.experts.down_proj_bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gpt_oss_gguf_matches_transformers(gpt_oss_released_limit, tmp_path):
    """A float32 GGUF written as llama.cpp's converter writes gpt-oss: transformers' logits, router choices and
    greedy tokens."""
    hf_path, hf = gpt_oss_released_limit
    llm = LLM(str(write_gpt_oss_gguf(tmp_path / "f32.gguf", hf_path)), dtype="float32", weights="float32",
              kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert (cfg.architecture, cfg.attention_sinks, cfg.rope_scaling.type, cfg.sliding_window) == \
        ("gpt_oss", True, "yarn", WINDOW)
    assert [cfg.window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert_reads_as_transformers(llm, hf)


def test_mxfp4_experts_run_at_their_own_size(gpt_oss_released_limit, tmp_path):
    """Experts in MXFP4, as the released files store them: read as float32 they are transformers' model with the same
    rounded weights (1e-4); by default each expert runs on its own MXFP4 blocks (136 bytes a 256, the file's size) on
    quickdraft's kernel, within the int8 activations' rounding of those weights, and speculation keeps its tokens."""
    import gguf.quants
    from gguf import GGMLQuantizationType as QT

    from quickdraft.models.block_linear import BlockLinear

    hf_path, hf = gpt_oss_released_limit
    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", hf_path, QT.MXFP4)

    def rounded(t: torch.Tensor) -> torch.Tensor:  # [E, rows, cols] through MXFP4 and back
        raw = gguf.quants.quantize(t.contiguous().numpy(), QT.MXFP4)
        return torch.from_numpy(gguf.quants.dequantize(raw, QT.MXFP4)).reshape(t.shape)

    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            gate_up = experts.gate_up_proj.data
            for half in (0, 1):
                gate_up[:, :, half::2] = rounded(gate_up[:, :, half::2].transpose(1, 2)).transpose(1, 2)
            experts.down_proj.data = rounded(experts.down_proj.data.transpose(1, 2)).transpose(1, 2).contiguous()
        ids = prompt(60)
        ref = hf(torch.tensor([ids])).logits[0].float()
    float_run = LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB")
    assert float_run.loaded.checkpoint.tensor_types["model.layers.0.mlp.experts.5.down_proj.weight"] == "MXFP4"
    floats = our_logits(float_run, ids)
    assert (floats - ref).abs().max().item() < 1e-4
    own = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    experts = [m for m in own.model.modules() if isinstance(m, BlockLinear) and m.kernel_name == "MXFP4"]
    assert len(experts) == 3 * 6 * 3  # layers x experts x (gate, up, down)
    assert sum(m.kweight.numel() for m in experts) == 3 * 6 * 3 * 32 * 64 // 32 * 17
    assert ((our_logits(own, ids) - floats).abs().max() / floats.abs().max()).item() < 0.03
    prompts = [prompt(8, seed=s) for s in (2, 3)] + [prompt(4, seed=5) * 5]
    plain = [o.token_ids for o in own.generate(prompts, GREEDY)]
    spec = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", speculative="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == plain


def write_packed_hf(path: Path, hf_path: Path) -> Path:
    """The checkpoint as the released gpt-oss directories store it: experts as MXFP4 ``*_blocks`` [E, rows, G, 16]
    (weight 2j in the low nibble of byte j) and ``*_scales`` [E, rows, G] (rows: gate and up alternating), rounded by
    gguf-py's MXFP4 quantizer, and the ``quantization_config`` that makes transformers read them."""
    import gguf.quants
    from gguf import GGMLQuantizationType as QT
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_path, path)
    state = load_file(hf_path / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), QT.MXFP4)).reshape(*w.shape[:2], -1, 17)
        values = torch.cat((raw[..., 1:] & 15, raw[..., 1:] >> 4), dim=-1)  # GGUF's order: weight j at j
        state[name + "_blocks"] = (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()
        state[name + "_scales"] = raw[..., 0].contiguous()
    save_file(state, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def packed_hf(gpt_oss_released_limit, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """The packed directory, and transformers' own reading of it (it dequantizes MXFP4 on a CPU)."""
    path = write_packed_hf(tmp_path_factory.mktemp("packed") / "model", gpt_oss_released_limit[0])
    return path, transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_mxfp4_packed_hf_experts_read_as_transformers_reads_them(packed_hf):
    """The released directories' MXFP4 experts, read as float32: transformers' logits (its own dequantization of
    the same directory) within 1e-4, its router choices and 48 greedy tokens."""
    path, hf = packed_hf
    llm = LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB")
    assert_reads_as_transformers(llm, hf)


def test_mxfp4_packed_hf_experts_run_at_their_own_size(packed_hf, gpt_oss_released_limit, tmp_path):
    """By default each expert runs on its own MXFP4 blocks, repacked as GGUF's: the GGUF of the same weights gives
    the same bits (same blocks, same kernel), and n-gram speculation keeps the greedy tokens."""
    from gguf import GGMLQuantizationType as QT

    from quickdraft.models.block_linear import BlockLinear

    own = LLM(str(packed_hf[0]), dtype="float32", kv_cache_memory="16MiB")
    experts = [m for m in own.model.modules() if isinstance(m, BlockLinear) and m.kernel_name == "MXFP4"]
    assert len(experts) == 3 * 6 * 3 and sum(m.kweight.numel() for m in experts) == 3 * 6 * 3 * 32 * 64 // 32 * 17
    gguf_run = LLM(str(write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", gpt_oss_released_limit[0], QT.MXFP4)),
                   dtype="float32", kv_cache_memory="16MiB")
    ids = prompt(60)
    assert torch.equal(our_logits(own, ids), our_logits(gguf_run, ids))
    start = [prompt(8, seed=s) for s in (2, 3)]
    plain = [o.token_ids for o in own.generate(start, GREEDY)]
    spec = LLM(str(packed_hf[0]), dtype="float32", kv_cache_memory="16MiB", speculative="ngram",
               num_speculative_tokens=3)
    assert [o.token_ids for o in spec.generate(start, GREEDY)] == plain


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"model.layers.1.mlp.experts.down_proj_blocks": torch.zeros(6, 64, 2, 16, dtype=torch.uint8)}),
     r"down_proj_blocks is torch.uint8 \[6, 64, 2, 16\]; the config needs uint8 \[6, 64, 1, 16\]"),
    (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_scales"), r"gate_up_proj_blocks has no gate_up_proj_scales"),
    (lambda t: t.update({"model.layers.2.mlp.experts.down_proj_scales": torch.zeros(6, 64, 2, dtype=torch.uint8)}),
     r"down_proj_scales is torch.uint8 \[6, 64, 2\]; the config needs uint8 \[6, 64, 1\]"),
    (lambda t: t["model.layers.1.mlp.experts.gate_up_proj_scales"].view(-1)[7].fill_(250),
     r"layers\.1\.mlp\.experts\.gate_up_proj_scales holds the exponent byte 250; .* 0\.\.248"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj": torch.zeros(6, 32, 64)}),
     r"layers\.0\.mlp\.experts\.down_proj is stored twice: unpacked and as MXFP4 blocks"),
])
def test_damaged_mxfp4_stacks_are_refused_by_name(packed_hf, tmp_path, edit, message):
    from safetensors.torch import load_file, save_file

    target = _edited(tmp_path, packed_hf[0])
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(target), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("experts_type", [None, "MXFP4"])
def test_llama_cpp_reads_the_gguf_as_we_do(gpt_oss_released_limit, tmp_path, experts_type):
    """The real peer on the same file (where llama-cpp-python is installed): its logits are ours within its own
    arithmetic (f16 products; MXFP4 with 8-bit activations), every position's argmax the same: the file's layout
    (sinks, window pattern, YaRN, biases, MXFP4 nibbles) is read as llama.cpp reads it."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install quickdraft[llamacpp])")
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from llama_cpp import Llama

    qtype = None if experts_type is None else QT[experts_type]
    path = write_gpt_oss_gguf(tmp_path / "m.gguf", gpt_oss_released_limit[0], qtype)
    ids = prompt(40)
    ours = our_logits(LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB"), ids)
    peer = Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    peer.eval(ids)
    theirs = torch.tensor(np.array(peer.scores[:len(ids)]))
    assert (ours - theirs).abs().max().item() < (2e-3 if qtype is None else 2e-2) * ours.abs().max().item()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_gpt_oss_gguf_ends_a_turn_on_harmonys_tokens(tmp_path):
    """<|return|> (the final answer's end) and <|call|> (a tool call's) end generation, as llama.cpp stops on them;
    <|end|> only ends one message of the turn (the analysis channel before the final one)."""
    from quickdraft.loading.gguf import eos_token_ids

    tokens = ["a", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    ids = eos_token_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 2}, "gpt-oss", len(tokens))
    assert set(ids) == {2, 3, 4}


def test_damaged_mxfp4_scales_are_refused_by_name():
    """An exponent byte past 2^120 (no model's weights; the kernel's arithmetic would overflow to NaN) is refused on
    every path that reads the blocks: the kernel's repacking and the dequantizer."""
    from quickdraft.loading.dequant import dequantize
    from quickdraft.loading.ggml_types import BY_NAME
    from quickdraft.models import block_formats

    raw = torch.zeros(4, 17, dtype=torch.uint8)
    raw[:, 0] = 120
    block_formats.repack("MXFP4", raw.reshape(-1), 2, 64)  # a model's scales: read
    raw[3, 0] = 249
    for read in (lambda: block_formats.repack("MXFP4", raw.reshape(-1), 2, 64),
                 lambda: dequantize(raw.reshape(-1), BY_NAME["MXFP4"], (2, 64))):
        with pytest.raises(ValueError, match=r"MXFP4 block's exponent byte is 249: a scale of 2\^121"):
            read()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_gpt_oss_layers_equal_the_module_path(gpt_oss_released_limit, tmp_path, dtype, monkeypatch):
    """MXFP4 experts on the kernel: every layer whole in one C call, its attention (sinks, output bias), router (bias)
    and experts (biases, clamped SwiGLU, ``qd_moe``) included, gives the module path's logits and caches bit for bit
    (a verify pass beside a decode token)."""
    from gguf import GGMLQuantizationType as QT

    from quickdraft.models.feed_forward import SparseMoE
    from test_fused import _verify_step

    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", gpt_oss_released_limit[0], QT.MXFP4)
    llm = LLM(str(path), dtype=dtype, kv_cache_memory="16MiB")
    assert all(layer.mlp.fused().act[0] == 2 for layer in llm.model.model.layers)  # the clamped SwiGLU in C
    fused, fused_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), True, monkeypatch)
    monkeypatch.setattr(SparseMoE, "fused", lambda self: None)
    modules, module_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), False, monkeypatch)
    assert fused_calls == 3 and module_calls == 0
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_the_clamped_swiglu_kernel_is_transformers_formula():
    """``qd_gated``'s clamped SwiGLU: transformers' float32 formula within a rounding (exp differs in its last bit at
    most), across and beyond the clamp; a NaN stays a NaN as torch.clamp keeps it; a limit that is no number is
    refused."""
    from quickdraft.models import native

    gate_up = torch.cat((torch.linspace(-12, 12, 4001), torch.linspace(-9, 9, 4001))).reshape(1, -1)
    gate_up[0, 7] = float("nan")
    gate, up = gate_up.chunk(2, dim=-1)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    ref = (u + 1) * g * torch.sigmoid(g * 1.702)
    got = native.gated(gate_up, "clamped_swiglu", 7.0, 1.702)
    assert torch.isnan(got[0, 7]) and torch.allclose(got, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    with pytest.raises(RuntimeError, match="qd_gated"):
        native.gated(gate_up, "clamped_swiglu", float("nan"), 1.702)


def test_a_step_reads_what_the_header_plans(gpt_oss_released_limit, tmp_path):
    """The bytes a decode step reads, planned from the GGUF's header alone (stacked expert biases included, a
    token's share of each stack), are what the loaded model's layers read."""
    from gguf import GGMLQuantizationType as QT

    from quickdraft.loading.quantize import planned_step_bytes
    from quickdraft.models import step_weight_bytes

    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", gpt_oss_released_limit[0], QT.MXFP4)
    planned, read = planned_step_bytes(path), step_weight_bytes(LLM(str(path), kv_cache_memory="16MiB").model)
    assert abs(read / planned - 1) < 0.05, (read, planned)
