"""Every model family equals HF transformers on a tiny random checkpoint built here, in float32.

Each family is built with transformers itself and saved with ``save_pretrained``; quickdraft loads the directory.
Prompts are longer than the sliding window, and speculation (another family's random model drafting, so drafts are
rejected and the cache rewinds, across the window's edge too) must not change a greedy token.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from conftest import gguf_read_whole, write_word_tokenizer
from quickdraft import LLM, SamplingParams
from quickdraft.errors import ModelLoadError
from test_parity import our_logits

VOCAB, WINDOW = 96, 12
# max abs difference of float32 logits (of magnitude 5-12) allowed between two implementations' roundings (measured:
# 1e-6 to 3e-6, docs/MEASUREMENTS.md)
TOLERANCE = 1e-4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, eos_token_id=0, bos_token_id=None)
LONGROPE = dict(short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i / 4 for i in range(8)])

FAMILIES = {
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(num_hidden_layers=3, **SMALL)),
    "qwen3-tied": (transformers.Qwen3ForCausalLM,
                   transformers.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True, **SMALL)),
    "llama3-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=2, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=32), **SMALL)),
    # biases on q/k/v and o (transformers' attention_bias; Qwen2's o has none)
    "llama-attention-bias": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=2, attention_bias=True, **SMALL)),
    "llama-linear-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=2, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0), **SMALL)),
    "llama-dynamic-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=2, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        **{**SMALL, "max_position_embeddings": 40})),
    "mistral": (transformers.MistralForCausalLM,
                transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SMALL)),
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, **SMALL)),
    # Gemma 2: every 2nd layer full, no q/k norms, attention scores and logits soft-capped (caps small enough to bend
    # this random model's scores of ~0.05 and logits of ~10); its query scale is the head's, as llama.cpp takes it
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=0.05,
        final_logit_softcapping=6.0, attn_implementation="eager", **SMALL)),
    # Gemma 3 with both caps set: transformers caps its logits and ignores the attention cap, as llama.cpp does
    "gemma3-capped": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=0.05,
        final_logit_softcapping=6.0, layer_types=["sliding_attention", "full_attention"], attn_implementation="eager",
        **SMALL)),
    "phi3-longrope": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        num_hidden_layers=2, original_max_position_embeddings=32, sliding_window=WINDOW,
        rope_scaling=dict(type="longrope", **LONGROPE), pad_token_id=0, **SMALL)),
    # Phi-4-mini: RoPE over the first 3/4 of each head (12 of 16 dims here: 6 frequencies), longrope, tied head
    "phi4-mini-partial": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        num_hidden_layers=2, original_max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=0,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=LONGROPE["short_factor"][:6], long_factor=LONGROPE["long_factor"][:6]),
        **SMALL)),
    # Granite 3: embeddings, attention scale, residual adds and logits each scaled by a multiplier of its own
    "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig(
        num_hidden_layers=2, embedding_multiplier=12.0, attention_multiplier=0.0390625, residual_multiplier=0.22,
        logits_scaling=0.125, tie_word_embeddings=True, rope_theta=10000.0, pad_token_id=0,
        **{k: v for k, v in SMALL.items() if k != "head_dim"})),
    # OLMo 2: norms only after attention and after the MLP, all of q and of k normed at once
    "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config(
        num_hidden_layers=2, rope_theta=10000.0, pad_token_id=0, **{k: v for k, v in SMALL.items() if k != "head_dim"})),
    # SmolLM3: every 4th layer attends without RoPE (NoPE)
    "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config(
        num_hidden_layers=4, rope_theta=10000.0, pad_token_id=0, **SMALL)),
}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            cls, cfg = FAMILIES[name]
            torch.manual_seed(0)
            model = cls(cfg).eval()
            with torch.no_grad():  # larger logits than the default init, so greedy choices are not near-ties
                for p in model.parameters():
                    if p.dim() == 1:  # norm weights away from their identity, as trained ones are
                        p.add_(torch.randn_like(p) * 0.2)
                model.get_output_embeddings().weight.mul_(8.0)
            path = root / name
            model.save_pretrained(path, safe_serialization=True)
            write_word_tokenizer(path, VOCAB)
            reloaded = cls.from_pretrained(path, dtype=torch.float32).eval()
            made[name] = (path, reloaded)
        return made[name]

    return make


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(family_dir, name):
    path, hf = family_dir(name)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    # prompts of dynamic and longrope scalings stay within the original context, where HF rotates every position of
    # a forward alike; past it HF's rotation depends on the forward's length, ours on the position (see rope.py)
    length = 30 if name in ("llama-dynamic-rope", "phi3-longrope", "phi4-mini-partial") else 5 * WINDOW
    ids = prompt(length)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (our_logits(llm, ids) - ref).abs().max().item()
    assert diff < TOLERANCE, f"{name}: max abs logit diff {diff}"
    # greedy decoding runs past the window and (dynamic, longrope) past the original context
    start = prompt(8, seed=2)
    expected = hf_greedy(hf, start, 48)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    assert llm.generate([start], params)[0].token_ids == expected
    # the model drafting for itself: every draft accepted, 4 tokens per verify pass, across the window's edge; another
    # family's random model: drafts rejected, the cache rewinds every round
    other = family_dir("llama-linear-rope" if name == "qwen3" else "qwen3")[0]
    for draft, accepted in ((path, True), (other, False)):
        spec = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", draft=str(draft), draft_weights="float32",
                   num_speculative_tokens=3)
        assert spec.generate([start], params)[0].token_ids == expected
        stats = spec.spec_stats
        assert stats.draft_tokens > 0 and (stats.accepted_tokens == stats.draft_tokens) == accepted


def test_config_fields_of_each_family(family_dir):
    cfg = LLM(str(family_dir("gemma3")[0]), dtype="float32", kv_cache_memory="16MiB").model.config
    assert (cfg.architecture, cfg.sliding_window, cfg.local_rope_theta, cfg.rope_theta) == ("gemma3", WINDOW, 1e4, 1e6)
    assert [cfg.window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.attention_scale == 24 ** -0.5
    assert cfg.rope_scaling.type == "linear" and cfg.embedding_multiplier == 64 ** 0.5
    gemma2 = LLM(str(family_dir("gemma2")[0]), dtype="float32", kv_cache_memory="16MiB").model.config
    assert (gemma2.architecture, gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == ("gemma2", 0.05, 6.0)
    assert [gemma2.window(i) for i in range(3)] == [WINDOW, None, WINDOW] and gemma2.local_rope_theta is None
    assert not gemma2.qk_norm and gemma2.sandwich_norms and gemma2.tie_word_embeddings
    assert gemma2.hidden_act == "gelu_tanh" and gemma2.attention_scale == 16 ** -0.5
    granite = LLM(str(family_dir("granite")[0]), dtype="float32", kv_cache_memory="16MiB").model.config
    assert (granite.embedding_multiplier, granite.attention_scale, granite.residual_multiplier,
            granite.logits_scaling) == (12.0, 0.0390625, 0.22, 0.125)
    phi = LLM(str(family_dir("phi3-longrope")[0]), dtype="float32", kv_cache_memory="16MiB").model.config
    assert phi.rope_scaling.type == "longrope" and phi.rope_scaling.original_max_position_embeddings == 32
    assert phi.rope_scaling.factor == 256 / 32 and [phi.window(i) for i in range(2)] == [WINDOW, WINDOW]


def test_gemma2_caps_of_null_are_none(family_dir, tmp_path):
    """A Gemma 2 config.json whose caps are null caps nothing, as transformers reads it; ones left out are
    transformers' defaults (50 and 30)."""
    path, _ = family_dir("gemma2")
    cfg = LLM(str(_edited(tmp_path, path, attn_logit_softcapping=None, final_logit_softcapping=None)),
              dtype="float32", kv_cache_memory="16MiB").model.config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (None, None)
    config = json.loads((path / "config.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        del config[key]
    (tmp_path / "edited" / "config.json").write_text(json.dumps(config))
    cfg = LLM(str(tmp_path / "edited"), dtype="float32", kv_cache_memory="16MiB").model.config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)


def _edited(tmp_path: Path, source: Path, **changes) -> Path:
    target = tmp_path / "edited"
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(changes)
    (target / "config.json").write_text(json.dumps(cfg))
    return target


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "falcon"}, r"unsupported model_type 'falcon'; supported: llama, mistral, qwen2, qwen3, gemma2, gemma3_text"),
    ({"rope_parameters": {"rope_type": "proportional", "factor": 4.0, "rope_theta": 1e4}},
     r"rope scaling 'proportional' is not supported; supported: default, linear, dynamic, llama3, longrope, yarn"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope scaling 'yarn' needs original_max_position_embeddings, an int in 2"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "beta_fast": float("inf"),
                          "original_max_position_embeddings": 32}}, r"rope scaling 'yarn' has a factor inf"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 32}},
     r"high_freq_factor > low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": float("nan"), "rope_theta": 1e4}},
     r"rope scaling 'linear' has a factor nan; allowed: 0.001 to 1e\+06"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 1e-320, "rope_theta": 1e4}},  # angles would overflow
     r"has a factor 1e-320; allowed"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}}, r"rope_theta=1e-300; allowed: above 1"),
    ({"sliding_window": 0, "use_sliding_window": True}, r"sliding_window=0; allowed: a number of tokens, an int in 1"),
    # found by hostile review: each loaded, then failed every request, truncated in C, or gave NaN logits
    ({"sliding_window": 2 ** 32 + 5, "use_sliding_window": True}, r"sliding_window=4294967301; allowed"),
    ({"sliding_window": True, "use_sliding_window": True}, r"sliding_window=True; allowed"),
    ({"sliding_window": 12.9, "use_sliding_window": True}, r"sliding_window=12.9; allowed"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 7,
                          "long_factor": [1.0] * 7, "original_max_position_embeddings": 32}},
     r"longrope factors have 7 entries; 16 rotated dims need 8, one per frequency"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is supported for phi3 only \(transformers rotates "
                                     r"whole heads of qwen3\)"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": "12345678",
                          "long_factor": [1.0] * 8, "original_max_position_embeddings": 32}},
     r"short_factor is str '12345678'; it must be a list of numbers"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [1.0] * 8, "original_max_position_embeddings": 1}},
     r"needs original_max_position_embeddings, an int in 2 to 16,777,216; got 1"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0,
                          "original_max_position_embeddings": -40}}, r"an int in 2 to 16,777,216; got -40"),
    ({"rope_parameters": {"rope_type": ["linear"], "rope_theta": 1e4}}, r"rope_type is \['linear'\]; supported"),
    ({"rope_parameters": "linear"}, r"rope_parameters is str 'linear'; it must be an object"),
    ({"rope_scaling": [4.0]}, r"rope_scaling is list \[4.0\]; it must be an object"),
    ({"head_dim": 15, "hidden_size": 60}, r"head_dim=15; rotary embeddings need an even head dimension"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0; allowed: an int in 1 to 16,777,216"),
    ({"max_position_embeddings": 1e300}, r"max_position_embeddings=1e\+300; allowed"),
    ({"rms_norm_eps": -1.0}, r"rms_norm_eps=-1.0; allowed: above 0 up to 1"),
    ({"num_attention_heads": 0, "num_key_value_heads": 0}, r"num_heads=0; allowed: an int in 1 to 1,048,576"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings is 'false'; it must be true or false"),
    ({"layer_types": ["full_attention"], "sliding_window": 8, "use_sliding_window": True},
     r"layer_types must name one of full_attention, sliding_attention for each of the 3 layers"),
    ({"hidden_act": "relu"}, r"activation 'relu' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(family_dir, tmp_path, changes, message):
    path = _edited(tmp_path, family_dir("qwen3")[0], **changes)  # qwen3: head_dim 16, 3 layers
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("name,changes,message", [
    ("smollm3", {"no_rope_layers": [1, 1, 1]}, r"no_rope_layers=\[1, 1, 1\]; it must list 1 \(RoPE\) or 0 \(none\) "
                                               r"for each of the 4 layers"),
    ("smollm3", {"no_rope_layers": [1, 2, 1, 0]}, r"no_rope_layers=\[1, 2, 1, 0\]; it must list"),
    ("smollm3", {"no_rope_layers": [1.0, 1, 1, 0]}, r"no_rope_layers=\[1.0, 1, 1, 0\]; it must list"),
    ("smollm3", {"no_rope_layers": None, "no_rope_layer_interval": 0}, r"no_rope_layer_interval=0; it must be an int"),
    ("phi4-mini-partial", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2}},
     r"partial_rotary_factor=2; allowed: a number above 0 up to 1"),
    ("phi4-mini-partial", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": "0.5"}},
     r"partial_rotary_factor='0.5'; allowed"),
    ("phi4-mini-partial", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.1}},  # 1 dim of 16: no pair to rotate
     r"partial_rotary_factor=0.1 rotates 1 of each head's 16 dims; RoPE needs an even number of at least 2"),
    ("phi4-mini-partial", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": True}},
     r"partial_rotary_factor=True; allowed: a number above 0 up to 1"),
    ("smollm3", {"no_rope_layers": None, "num_hidden_layers": 10 ** 15},  # (never a loop over 10^15 layers)
     r"num_hidden_layers=1000000000000000; allowed: an int in 1 to 1,048,576"),
    ("phi4-mini-partial", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                                               "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                               "original_max_position_embeddings": 32}},
     r"longrope factors have 8 entries; 12 rotated dims need 6, one per frequency"),
    ("granite", {"residual_multiplier": float("nan")}, r"residual_multiplier=nan; allowed: 0.001 to 1e\+09"),
    ("granite", {"logits_scaling": 0}, r"logits_scaling=0; allowed: 0.001 to 1e\+09"),
    ("granite", {"attention_multiplier": 1e300}, r"attention_multiplier=1e\+300; allowed: 1e-06 to 1000"),
    ("granite", {"embedding_multiplier": "12"}, r"embedding_multiplier='12'; allowed"),
    ("granite", {"residual_multiplier": None}, r"residual_multiplier=None; allowed: 0.001 to 1e\+09"),
    ("granite", {"logits_scaling": None}, r"logits_scaling=None; allowed"),
    ("gemma2", {"attn_logit_softcapping": float("nan")}, r"attn_logit_softcapping=nan; allowed: 0.001 to 1e\+09"),
    ("gemma2", {"final_logit_softcapping": 0}, r"final_logit_softcapping=0; allowed: 0.001 to 1e\+09"),
    ("gemma2", {"attn_logit_softcapping": "50"}, r"attn_logit_softcapping='50'; allowed"),
    ("gemma2", {"final_logit_softcapping": -30.0}, r"final_logit_softcapping=-30.0; allowed"),
    ("gemma3", {"final_logit_softcapping": float("inf")}, r"final_logit_softcapping=inf; allowed"),
])
def test_damaged_family_settings_are_refused_by_name(family_dir, tmp_path, name, changes, message):
    path = _edited(tmp_path, family_dir(name)[0], **changes)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("name", ["phi4-mini-partial", "smollm3", "granite", "olmo2", "gemma2"])
@pytest.mark.parametrize("weights,dtype", [("int8", "bfloat16"), ("int4", "float32")])
def test_fused_layers_equal_the_module_path(family_dir, name, weights, dtype, monkeypatch):
    """RoPE over part of each head, layers without it, Granite's residual multiplier and attention scale, OLMo 2's
    layers without norms before their blocks and its whole-q/k norms, Gemma 2's soft-capped scores inside the fused C
    layer: a verify pass beside a decode token gives the module path's logits and caches bit for bit, every layer
    fused."""
    from test_fused import _verify_step

    llm = LLM(str(family_dir(name)[0]), weights=weights, dtype=dtype, kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert (cfg.rotated_dims, cfg.unrotated_layers, cfg.residual_multiplier) == {
        "phi4-mini-partial": (12, (), 1.0), "smollm3": (16, (3,), 1.0), "granite": (16, (), 0.22),
        "olmo2": (16, (), 1.0), "gemma2": (16, (), 1.0)}[name]
    fused, fused_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), True, monkeypatch)
    modules, module_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), False, monkeypatch)
    assert fused_calls == cfg.num_layers and module_calls == 0
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mistral", "phi3-longrope", "llama3-rope", "phi4-mini-partial",
                                  "smollm3", "granite", "olmo2", "gemma2"])
def test_family_through_the_engine(family_dir, name, weights):
    """Quantized and bfloat16 weights (the fused C layer where it applies): a batch equals each prompt alone, a
    repeated prompt reads its cached prefix, and every drafter keeps greedy output unchanged."""
    path = family_dir(name)[0]
    prompts = [prompt(n, seed=n) for n in (5, 2 * WINDOW + 3, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(weights=weights, kv_cache_memory="16MiB")
    if weights == "bfloat16":
        options = dict(dtype="bfloat16", kv_cache_memory="16MiB")
    llm = LLM(str(path), **options)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    hits = llm.engine.prefix_cache_hits
    assert llm.generate([prompts[2]], params)[0].token_ids == alone[2]
    assert llm.engine.prefix_cache_hits > hits  # its prompt's full blocks came from the prefix cache
    for spec in (dict(speculative="ngram"), dict(speculative="self"), dict(draft=str(path), draft_weights=weights)):
        if weights == "bfloat16" and "draft" in spec:
            spec["draft_weights"] = "float32"
        drafted = LLM(str(path), **options, num_speculative_tokens=3, **spec)
        assert [o.token_ids for o in drafted.generate(prompts, params)] == alone, spec


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers():
    """Real weights of a sliding-window family: the packaged Gemma 3 270M, dequantized to float32, gives
    transformers' greedy tokens (transformers reads the same GGUF itself) for a prompt longer than its 512-key
    window, and the file's own int4/int8 weights keep greedy output unchanged under speculation."""
    from quickdraft.loading import resolve_model

    try:
        path = resolve_model("gemma3-270m")
    except ModelLoadError as exc:
        pytest.skip(f"Gemma 3 270M is not installed (make models-gemma): {exc}")
    with gguf_read_whole():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    llm = LLM(str(path), weights="float32", kv_cache_memory="128MiB")
    text = Path(__file__).read_text()[:2400]  # this file's source: ~700 tokens of code
    for ids in (llm.tokenizer.encode("The capital of France is"), llm.tokenizer.encode(text)):
        assert llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids \
            == hf_greedy(hf, ids, 16)
    del hf
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 512
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    default = LLM(str(path), kv_cache_memory="128MiB")
    plain = default.generate([ids], params)[0].token_ids
    for spec in (dict(speculative="ngram"), dict(draft=str(path))):
        assert LLM(str(path), kv_cache_memory="128MiB", **spec).generate([ids], params)[0].token_ids == plain


@pytest.mark.parametrize("name", ["gemma3", "mistral", "gemma2"])
@pytest.mark.parametrize("kernel", [True, False])
def test_sliding_window_on_torch_attention(family_dir, name, kernel, monkeypatch):
    """Off quickdraft's CPU kernel (a GPU, or a head layout the kernel does not take) single tokens attend through
    torch per key bucket; where the kernel does not run at all (``kernel`` False), a prompt's long pieces attend in
    torch's causal call too. Their window (and Gemma 2's soft-capped scores) must hold there as well."""
    from quickdraft.kv import ForwardItem, SequenceKV, attention

    if kernel:
        monkeypatch.setattr(attention.native, "runs_attend", lambda q, cache: False)
    else:
        monkeypatch.setattr(attention, "native_attention", lambda pool: False)
    path, hf = family_dir(name)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    ids = prompt(5 * WINDOW)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (our_logits(llm, ids) - ref).abs().max().item() < TOLERANCE  # every row: single tokens
    kv = SequenceKV()  # the prompt as a chunk: off the kernel, one piece in torch's causal call
    (last,) = llm.target.forward([ForwardItem(kv, ids, 1)])
    llm.target.free(kv)
    assert (last[-1] - ref[-1]).abs().max().item() < TOLERANCE
    start = prompt(8, seed=2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    assert llm.generate([start], params)[0].token_ids == hf_greedy(hf, start, 48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["gemma3", "qwen3", "phi3-longrope"])
def test_family_on_cuda(family_dir, name):
    """The CUDA path (torch's attention with windows, RoPE tables on the device) gives transformers' greedy tokens."""
    path, hf = family_dir(name)
    llm = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory="16MiB")
    start = prompt(8, seed=2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    assert llm.generate([start], params)[0].token_ids == hf_greedy(hf, start, 48)
    spec = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory="16MiB", speculative="self",
               num_speculative_tokens=3)
    assert spec.generate([start], params)[0].token_ids == hf_greedy(hf, start, 48)


def test_gemma3_family_serves_and_resumes_sessions(family_dir, tmp_path):
    """A sliding-window family behind the real HTTP server (the openai client, streaming and not) and in a session
    saved to disk and resumed: the same greedy tokens as transformers."""
    from test_server import serve

    path, hf = family_dir("gemma3")
    start = prompt(8, seed=2)
    expected = hf_greedy(hf, start, 40)
    with serve(path, "gemma", speculative="ngram") as server:
        client = server.client()
        text = " ".join(f"t{i}" for i in start)
        done = client.completions.create(model="gemma", prompt=text, max_tokens=40, temperature=0.0,
                                          extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="gemma", prompt=text, max_tokens=40, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    assert done.choices[0].text == streamed
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    assert llm.tokenizer.encode(done.choices[0].text, add_special_tokens=False) == expected
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with llm.session() as s:
        first = s.generate(start, params).token_ids
        s.save(tmp_path / "gemma.qds")
    resumed = llm.load_session(tmp_path / "gemma.qds")
    assert first + resumed.generate(None, params).token_ids == expected


def test_rope_tables_cover_the_engines_context_only(family_dir):
    """RoPE tables are made for the positions the engine reaches (its context plus a verify pass), not the model's
    whole trained context; a position past them is refused, never read out of bounds."""
    from quickdraft.kv import ForwardItem, SequenceKV

    llm = LLM(str(family_dir("gemma3")[0]), dtype="float32", kv_cache_memory="16MiB", max_model_len=40,
              num_speculative_tokens=3)
    limit = llm.model.max_positions  # the context, plus a verify pass's reach past it
    ropes = llm.model.ropes
    assert limit == ropes["local"].max_positions and 40 < limit <= 40 + 16 < llm.model.config.max_position_embeddings
    assert ropes["global"].cos.shape == (limit, 8)
    out = llm.generate([prompt(8)], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 32  # up to max_model_len
    with pytest.raises(ValueError, match=f"position {limit} is past the {limit} this model was limited to"):
        llm.target.forward([ForwardItem(SequenceKV(), prompt(limit + 1), limit + 1)])


def test_rope_tables_grow_with_the_positions_reached():
    from quickdraft.config import RopeScaling
    from quickdraft.models.rope import rope_tables
    from quickdraft.models.transformer import RotaryEmbedding

    scaling = RopeScaling("longrope", **{k: tuple(v) for k, v in LONGROPE.items()}, original_max_position_embeddings=300)
    full = rope_tables(16, 1e4, scaling, 9000)  # computed 4096 rows at a time: rows never depend on the chunking
    rope = RotaryEmbedding(16, 1e4, 9000, scaling)
    for end, rows in ((10, 256), (256, 256), (300, 512), (5000, 5000), (5001, 9000)):
        rope.reach(end)
        assert len(rope.cos) == rows
        assert torch.equal(rope.cos, full[0][:rows]) and torch.equal(rope.sin, full[1][:rows])
    rope.limit(100)
    rope.reach(100)
    assert len(rope.cos) == 100


def test_a_draft_sharing_no_tokens_is_refused_naming_both(family_dir, tiny_dir):
    """Word-level test vocabularies spell no bytes: nothing to draft over (see test_cross_vocab.py for drafts of
    another vocabulary that do share tokens)."""
    with pytest.raises(ModelLoadError, match=r"the draft model m\d+ and the target qwen3 share 0 tokens \(of 64 and "
                                             r"96\); a draft of another vocabulary needs at least 32 shared tokens"):
        LLM(str(family_dir("qwen3")[0]), draft=str(tiny_dir(vocab_size=64)), dtype="float32", kv_cache_memory="16MiB")


def test_an_adapter_on_olmo2_reads_the_stream_as_its_layers_do(family_dir, tmp_path, monkeypatch):
    """OLMo 2's blocks read the residual stream itself (no norm before them), and an adapter's terms must too: every
    prompt position's logprob is PEFT's, and int8 fused layers with the adapter give the module path's bits."""
    from quickdraft.kv import ForwardItem
    from quickdraft.models.transformer import DecoderLayer, Transformer
    from test_lora import make_adapter, peft_logprobs

    path = family_dir("olmo2")[0]
    adapter = make_adapter(path, tmp_path / "adapter", seed=3)
    ids = prompt(40)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", lora_adapters={"a": str(adapter)})
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, lora="a"))[0]
    want = peft_logprobs(path, adapter, ids)
    assert max(abs(out.prompt_logprobs[p]["logprob"] - want[p - 1, ids[p]].item()) for p in range(1, len(ids))) < 2e-4
    runner = LLM(str(path), weights="int8", kv_cache_memory="16MiB", lora_adapters={"a": str(adapter)}).target
    fused_calls: list[int] = []
    real = DecoderLayer.fused
    monkeypatch.setattr(DecoderLayer, "fused", lambda self, rope: fused_calls.append(1) or real(self, rope))

    def step() -> list[torch.Tensor]:  # a verify pass under the adapter beside a base decode token
        kvs = [runner.new_kv("a"), runner.new_kv(None)]
        for kv in kvs:
            runner.forward([ForwardItem(kv, prompt(20), 1)])
        rows = runner.forward([ForwardItem(kvs[0], prompt(5, seed=3), 5), ForwardItem(kvs[1], [7], 1)])
        out = [*rows, *(runner.gather(kv)[part] for kv in kvs for part in ("k", "v"))]
        for kv in kvs:
            runner.free(kv)
        return out

    fused = step()
    assert fused_calls
    monkeypatch.setattr(DecoderLayer, "fused", lambda self, rope: None)
    monkeypatch.setattr(Transformer, "fused_stack", lambda self, n: None)
    assert all(torch.equal(a, b) for a, b in zip(fused, step()))
