"""gpt-oss from a Hugging Face directory equals transformers on a tiny random checkpoint that transformers builds and
saves itself, in float32: its attention sinks (a learned logit per head in every softmax), alternating sliding and
full layers, YaRN RoPE, biases on q/k/v/o, the router's bias and softmax over its top-k, and the experts' clamped
SwiGLU with biases (stored stacked, transposed, gate and up interleaved). Logits, the router's choices on every token
of every layer, 48 greedy tokens, through speculation, on int8 weights and in the static step; damaged files are
refused by name. (GGUF gpt-oss and its MXFP4 experts are not supported: docs/MEASUREMENTS.md.)"""
from __future__ import annotations

import json
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
from test_moe import hf_router_choices, our_router_choices
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
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():  # transformers' init leaves biases and sinks at 0: give them values that matter
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("bias") or "router" in name:
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
        model.get_output_embeddings().weight.mul_(8.0)
    path = tmp_path_factory.mktemp("gpt_oss") / "model"
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return path, transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_gpt_oss_matches_transformers(gpt_oss):
    path, hf = gpt_oss
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.attention_sinks, cfg.rope_scaling.type) == ("gpt_oss", 6, True, "yarn")
    assert [cfg.window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    ids = prompt(60)  # far past the window: sliding layers drop keys
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (our_logits(llm, ids) - ref).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff {diff}"
    theirs, ours = hf_router_choices(hf, ids), our_router_choices(llm, ids)
    assert len(ours) == len(theirs) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    start = prompt(8, seed=2)
    assert llm.generate([start], GREEDY)[0].token_ids == hf_greedy(hf, start, 48)


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
