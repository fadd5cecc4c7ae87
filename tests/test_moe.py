"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) equal HF transformers on tiny random checkpoints that
transformers builds and saves itself, in float32: logits, the router's choices on every token of every layer, greedy
tokens (also through speculation that rejects and that accepts); only the chosen experts run, each once per forward;
the quantized formats and every drafter keep greedy output; a config that does not match the tensors is refused by
name before any weight is read."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers

from conftest import write_word_tokenizer
from quickdraft import LLM, SamplingParams
from quickdraft.errors import ModelLoadError
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.models.feed_forward import Router, SparseMoE
from test_families import _edited, hf_greedy, prompt
from test_parity import our_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gguf_files import add_metadata  # noqa: E402

VOCAB = 96
TOLERANCE = 1e-4  # as test_families.py
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, eos_token_id=0, bos_token_id=None, num_hidden_layers=3)

FAMILIES = {
    # a dense layer among the sparse ones (mlp_only_layers), experts narrower than it, renormalized top-k
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], **SMALL)),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, **SMALL)),
    # top-k weights not renormalized, q and k normalized whole, q/k/v clamped
    "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
        intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=2.5, **SMALL)),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            cls, cfg = FAMILIES[name]
            torch.manual_seed(0)
            model = cls(cfg).eval()
            with torch.no_grad():  # larger logits and router logits than the default init: no near-ties
                for pname, p in model.named_parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.2)
                    elif "gate" in pname and "proj" not in pname and not pname.endswith(("w1.weight", "w3.weight")):
                        p.normal_(0.0, 0.5)  # the router
                model.get_output_embeddings().weight.mul_(8.0)
            path = root / name
            model.save_pretrained(path, safe_serialization=True)
            write_word_tokenizer(path, VOCAB)
            made[name] = (path, cls.from_pretrained(path, dtype=torch.float32).eval())
        return made[name]

    return make


def hf_router_choices(hf: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """Per sparse layer, the experts HF's router picks for each token ``[T, k]`` (sorted)."""
    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: picked.append(out[2].sort(-1).values)) for r in routers]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return picked


def our_router_choices(llm: LLM, ids: list[int]) -> list[torch.Tensor]:
    routers = [m for m in llm.model.modules() if isinstance(m, Router)]
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: picked.append(out[1].sort(-1).values)) for r in routers]
    our_logits(llm, ids)
    for h in hooks:
        h.remove()
    return picked


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_family_matches_transformers(moe_dir, name):
    path, hf = moe_dir(name)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert cfg.architecture == name and cfg.num_experts == (6 if name == "mixtral" else 8)
    ids = prompt(60)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (our_logits(llm, ids) - ref).abs().max().item()
    assert diff < TOLERANCE, f"{name}: max abs logit diff {diff}"
    theirs, ours = hf_router_choices(hf, ids), our_router_choices(llm, ids)
    assert len(ours) == len(theirs) == (2 if name == "qwen3_moe" else 3)  # qwen3_moe's layer 1 is dense
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    start = prompt(8, seed=2)
    expected = hf_greedy(hf, start, 48)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    assert llm.generate([start], params)[0].token_ids == expected
    other = moe_dir("mixtral" if name != "mixtral" else "olmoe")[0]
    for draft, accepted in ((path, True), (other, False)):  # itself: all accepted; another model: rejected
        spec = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", draft=str(draft), draft_weights="float32",
                   num_speculative_tokens=3)
        assert spec.generate([start], params)[0].token_ids == expected
        stats = spec.spec_stats
        assert stats.draft_tokens > 0 and (stats.accepted_tokens == stats.draft_tokens) == accepted


def test_only_the_chosen_experts_run_once_per_forward(moe_dir):
    """A verify pass of 5 tokens: each expert any of them chose runs once, on the rows that chose it; the others
    are not called (their weights are not read)."""
    llm = LLM(str(moe_dir("qwen3_moe")[0]), dtype="float32", kv_cache_memory="16MiB")
    runner = llm.loaded.engine.target
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, prompt(20), 1)])
    layer = llm.model.model.layers[0].mlp
    assert isinstance(layer, SparseMoE)
    rows_seen: dict[int, list[int]] = {}
    hooks = [expert.register_forward_hook(lambda _m, inputs, _o, e=e: rows_seen.setdefault(e, []).append(
        inputs[0].shape[0])) for e, expert in enumerate(layer.experts)]
    choices = []
    router_hook = layer.gate.register_forward_hook(lambda _m, _i, out: choices.append(out[1]))
    runner.forward([ForwardItem(kv, prompt(5, seed=9), 5)])
    for h in hooks + [router_hook]:
        h.remove()
    chosen = choices[0]
    assert sorted(rows_seen) == sorted(set(chosen.flatten().tolist())) and len(rows_seen) < 8
    assert all(calls == [int((chosen == e).sum())] for e, calls in rows_seen.items())


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16"])
def test_moe_through_the_engine(moe_dir, weights):
    """Quantized experts (every expert's linears in the format) and bfloat16: a batch equals each prompt alone, a
    repeated prompt reads its cached prefix, and every drafter keeps greedy output unchanged."""
    path = moe_dir("qwen3_moe")[0]
    prompts = [prompt(n, seed=n) for n in (5, 27, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(dtype="bfloat16", kv_cache_memory="16MiB") if weights == "bfloat16" else \
        dict(weights=weights, kv_cache_memory="16MiB")
    llm = LLM(str(path), **options)
    # quantized experts: every layer, router and experts included, in one C call; bfloat16 experts run as modules
    assert (llm.model.fused_stack(None) is not None) == (weights != "bfloat16")
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    hits = llm.engine.prefix_cache_hits
    assert llm.generate([prompts[2]], params)[0].token_ids == alone[2]
    assert llm.engine.prefix_cache_hits > hits
    draft_weights = "float32" if weights == "bfloat16" else weights
    for spec in (dict(speculative="ngram"), dict(speculative="self"),
                 dict(draft=str(path), draft_weights=draft_weights)):
        drafted = LLM(str(path), **options, num_speculative_tokens=3, **spec)
        assert [o.token_ids for o in drafted.generate(prompts, params)] == alone, spec


@pytest.mark.parametrize("changes, message", [
    ({"num_local_experts": 6}, r"tensor model\.layers\.0\.mlp\.experts\.6\.down_proj\.weight is not in the model "
                               r"config \(num_experts=6; 12 such tensors\)"),
    ({"num_local_experts": 10}, r"missing tensors model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9; allowed: an int in 1 to num_experts=8"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0; allowed"),
    ({"num_local_experts": 1e9}, r"num_experts=1000000000.0; allowed: an int in 0 \(dense\) to 4,096"),
    ({"moe_intermediate_size": 40}, r"tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape "
                                    r"\(32, 64\), expected \(40, 64\)"),
    ({"mlp_only_layers": [0, 1]}, r"checkpoint is missing tensors model\.layers\.0\.mlp\.gate_proj\.weight"),
    ({"mlp_only_layers": [7]}, r"dense_layers=\[7\]; allowed: layer numbers below 3"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 and mlp_only_layers=\[1\] must be"),
])
def test_mismatched_moe_configs_are_refused_by_name(moe_dir, tmp_path, changes, message, monkeypatch):
    path = _edited(tmp_path, moe_dir("qwen3_moe")[0], **changes)
    read = []
    monkeypatch.setattr("quickdraft.loading.hf._converted", lambda *a, **k: read.append(1))
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    assert not read  # refused from the header, before any weight was read


# ---- GGUF: the stacked expert tensors llama.cpp's converter writes ----------------------------------------------
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for llama files (what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_model_keys(w, cfg: dict) -> None:
    """The layer sizes, norm epsilon and RoPE base of an HF ``config.json`` as GGUF keys (``w``: a GGUFWriter)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])


def add_word_tokenizer(w, vocab: int = VOCAB) -> None:
    """A word-level list of ``vocab`` tokens as GGUF tokenizer keys: <eos> (id 0) a control token."""
    w.add_tokenizer_model("llama")
    w.add_token_list(["<eos>"] + [f"t{i}" for i in range(1, vocab)])
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_types([3] + [1] * (vocab - 1))  # <eos> a control token, the others normal
    w.add_eos_token_id(0)


def write_gguf(path: Path, hf_path: Path, name: str, qtype=None, expert_count: int | None = None,
               expert_used: int | None = None, tokenizer: dict | None = None) -> Path:
    """``hf_path``'s checkpoint as llama.cpp's converter writes it: experts stacked per block, q/k permuted for
    llama, the family's expert keys (``expert_count``/``expert_used``: other values than the checkpoint's, as a
    damaged file would declare); 2-D and 3-D weights in ``qtype`` (default float32); ``tokenizer``: another
    file's ``tokenizer.*`` metadata (default: a word-level list of the model's vocabulary)."""
    import gguf.quants
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((hf_path / "config.json").read_text())
    arch, state = GGUF_ARCH[name], load_file(hf_path / "model.safetensors")
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    w = GGUFWriter(str(path), arch)
    add_model_keys(w, cfg)
    w.add_expert_count(experts if expert_count is None else expert_count)
    w.add_expert_used_count(cfg["num_experts_per_tok"] if expert_used is None else expert_used)
    if name == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("clip_qkv"):
        w.add_float32("olmoe.attention.clamp_kqv", cfg["clip_qkv"])
    if tokenizer is not None:
        add_metadata(w, tokenizer)
    else:
        add_word_tokenizer(w)

    def add(gguf_name: str, t: torch.Tensor) -> None:
        t = t.float().numpy()
        if qtype is not None and t.ndim >= 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, t)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {k.removeprefix(p).replace("block_sparse_moe.", "mlp.").replace(".weight", ""): v
                 for k, v in state.items() if k.startswith(p)}
        for hf, kind in GGUF_LAYER.items():
            if hf in layer:
                t = layer[hf]
                if arch == "llama" and kind in ("attn_q", "attn_k"):
                    t = llama_permute(t, cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
                add(f"blk.{i}.{kind}.weight", t)
        for kind, parts in (("ffn_gate_exps", ("gate_proj", "w1")), ("ffn_up_exps", ("up_proj", "w3")),
                            ("ffn_down_exps", ("down_proj", "w2"))):
            stack = [next((layer[f"mlp.experts.{e}.{n}"] for n in parts if f"mlp.experts.{e}.{n}" in layer), None)
                     for e in range(experts)]
            if stack[0] is not None:
                add(f"blk.{i}.{kind}.weight", torch.stack(stack))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_gguf_matches_transformers(moe_dir, tmp_path, name):
    """A float32 GGUF of each family: transformers' logits and router choices, and its greedy tokens."""
    hf_path, hf = moe_dir(name)
    path = write_gguf(tmp_path / f"{name}.gguf", hf_path, name)
    llm = LLM(str(path), dtype="float32", weights="float32", kv_cache_memory="16MiB")
    cfg = llm.model.config
    assert (cfg.architecture, cfg.num_experts, cfg.norm_topk_prob) == (name, 6 if name == "mixtral" else 8,
                                                                     name != "olmoe")
    ids = prompt(60)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (our_logits(llm, ids) - ref).abs().max().item() < TOLERANCE
    assert all(torch.equal(a, b) for a, b in zip(our_router_choices(llm, ids), hf_router_choices(hf, ids)))
    start = prompt(8, seed=2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    assert llm.generate([start], params)[0].token_ids == hf_greedy(hf, start, 48)


def test_moe_gguf_experts_at_their_own_size(moe_dir, tmp_path):
    """A Q8_0 file: each expert runs on its own blocks (the file's bytes), its greedy tokens equal those of the same
    file's dequantized weights, and speculation keeps them."""
    from gguf import GGMLQuantizationType as QT

    path = write_gguf(tmp_path / "q8.gguf", moe_dir("qwen3_moe")[0], "qwen3_moe", QT.Q8_0)
    own = LLM(str(path), dtype="float32", weights="gguf", kv_cache_memory="16MiB")
    assert own.loaded.checkpoint.tensor_types["model.layers.2.mlp.experts.7.down_proj.weight"] == "Q8_0"
    prompts = [prompt(n, seed=n) for n in (5, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), dtype="float32", weights="float32",
                                         kv_cache_memory="16MiB").generate(prompts, params)]
    assert [o.token_ids for o in own.generate(prompts, params)] == expected
    spec = LLM(str(path), dtype="float32", weights="gguf", kv_cache_memory="16MiB", speculative="ngram")
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_in_one_c_call_give_the_module_paths_bits(moe_dir, dtype):
    """Quantized experts run as one qd_moe call; the module path (a torch loop over the chosen experts) gives the
    same bits, for a decode row, a verify pass and a prompt chunk."""
    llm = LLM(str(moe_dir("qwen3_moe")[0]), weights="int8", dtype=dtype, kv_cache_memory="16MiB")
    moe = llm.model.model.layers[0].mlp
    assert moe.fused() is not None
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64, generator=g).to(getattr(torch, dtype))
        fused = moe(x)
        cached, moe._fused = moe._fused, (moe._fused[0], None)  # the module path
        try:
            assert torch.equal(moe(x), fused)
        finally:
            moe._fused = cached


def test_every_path_on_a_mixture(moe_dir, tmp_path):
    """A mixture as the target of suffix speculation and as another mixture's draft, a session saved and resumed
    mid-conversation, and the memory plan counting every expert (not only the chosen ones)."""
    target, draft = str(moe_dir("olmoe")[0]), str(moe_dir("qwen3_moe")[0])
    prompts = [prompt(n, seed=n) for n in (6, 33)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = LLM(target, dtype="float32", kv_cache_memory="16MiB")
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    for spec in (dict(speculative="suffix"), dict(draft=draft, draft_weights="int8", num_speculative_tokens=3)):
        llm = LLM(target, dtype="float32", kv_cache_memory="16MiB", **spec)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected, spec
    session = plain.session()
    first = session.generate(prompts[0], params).token_ids
    session.save(tmp_path / "moe.snapshot")
    second = session.generate(prompt(4, seed=7), params).token_ids
    resumed = LLM(target, dtype="float32", kv_cache_memory="16MiB").load_session(tmp_path / "moe.snapshot")
    assert first == expected[0] and resumed.generate(prompt(4, seed=7), params).token_ids == second
    experts = sum(p.numel() * 4 for name, p in plain.model.named_parameters() if ".experts." in name)
    assert plain.loaded.memory.weights["target"] >= experts  # every expert is planned for


def test_the_seeded_cost_model_prices_the_union_of_experts():
    """Seeded requests plan k from bytes: a verify pass of an MoE target reads the union of its tokens' experts, so
    5 tokens cost about three decode steps here (a dense model's: 1.04)."""
    from quickdraft.speculative.cost import CostModel

    dense = CostModel.from_weight_bytes(100, 10)
    assert dense.target(5) / dense.target(1) == pytest.approx(1.04)
    moe = CostModel.from_weight_bytes(1000, 10, experts=(960, 8 / 128))  # a token reads 40 + 60 bytes
    assert moe.target(5) / moe.target(1) == pytest.approx((40 + 960 * (1 - (1 - 1 / 16) ** 5)) / 100 + 0.04)
    assert moe.draft(1) == pytest.approx(10 / 100)  # beside what a step reads, not beside every expert


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("weights,dtype", [("int8", "bfloat16"), ("int4", "float32")])
def test_fused_attention_of_a_mixtures_layer_equals_the_module_path(moe_dir, tmp_path, name, weights, dtype,
                                                                    monkeypatch):
    """A verify pass beside a decode token: every layer whole in one C call (``FusedStack``; a sparse layer's router
    and experts inside it; OLMoE's whole-q/k norms, as the released model has no clamp) gives the module path's
    logits and caches bit for bit."""
    from test_fused import _verify_step

    path = moe_dir(name)[0] if name == "qwen3_moe" else _edited(tmp_path, moe_dir(name)[0], clip_qkv=None)
    llm = LLM(str(path), weights=weights, dtype=dtype, kv_cache_memory="16MiB")
    fused, fused_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), True, monkeypatch)
    modules, module_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), False, monkeypatch)
    assert fused_calls == llm.model.config.num_layers and module_calls == 0
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_olmoe_with_its_clamp_keeps_the_module_path(moe_dir):
    """The fused C layer has no clamp: OLMoE's layers with ``clip_qkv`` are not fused (without it they are, above)."""
    llm = LLM(str(moe_dir("olmoe")[0]), weights="int8", kv_cache_memory="16MiB")
    model = llm.model
    assert model.config.clip_qkv == 2.5
    assert all(layer.fused(model.rope_of(layer)) is None for layer in model.model.layers)


def test_a_replaced_router_rebuilds_the_fused_layer(moe_dir, monkeypatch):
    """A router weight replaced after loading (a new Parameter, other values): the fused layer is rebuilt on it, and
    the step still gives the module path's bits."""
    from test_fused import _verify_step

    llm = LLM(str(moe_dir("qwen3_moe")[0]), weights="int8", kv_cache_memory="16MiB")
    layer = next(layer for layer in llm.model.model.layers if layer.sparse)
    rope = llm.model.rope_of(layer)
    before = layer.fused(rope)
    assert before is not None and before.whole
    gate = layer.mlp.gate
    gate.weight = torch.nn.Parameter(torch.flip(gate.weight.detach(), [0]).clone())
    assert layer.fused(rope) is not before
    fused, fused_calls = _verify_step(llm, prompt(20), prompt(5, seed=3), True, monkeypatch)
    modules, _ = _verify_step(llm, prompt(20), prompt(5, seed=3), False, monkeypatch)
    assert fused_calls == llm.model.config.num_layers
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_a_mixture_served_over_http(moe_dir):
    """The OpenAI-compatible server on a quantized mixture with n-gram speculation: the real openai client gets, plain
    and streamed, the text LLM.generate gives."""
    from test_server import serve

    path = moe_dir("qwen3_moe")[0]
    text = " ".join(f"t{i}" for i in prompt(12, seed=5))
    expected = LLM(str(path), weights="int8", dtype="float32", kv_cache_memory="16MiB").generate(
        [text], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].text
    with serve(path, "moe", weights="int8", speculative="ngram") as server:
        client = server.client()
        done = client.completions.create(model="moe", prompt=text, max_tokens=16, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == expected
        stream = client.completions.create(model="moe", prompt=text, max_tokens=16, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


@pytest.mark.parametrize("count, used, message", [
    (6, None, r"tensor blk\.0\.ffn_gate_exps\.weight stacks 8 experts; the config has num_experts=6"),
    (0, None, r"tensor blk\.0\.ffn_down_exps\.weight holds experts but GGUF metadata 'qwen3moe\.expert_count' is "
              r"absent or 0"),
    (None, 9, r"'qwen3moe\.expert_used_count'"),
    (None, 0, r"'qwen3moe\.expert_used_count'"),
    (1 << 30, None, r"'qwen3moe\.expert_count'"),
])
def test_a_gguf_whose_expert_counts_do_not_match_is_refused_by_name(moe_dir, tmp_path, count, used, message):
    path = write_gguf(tmp_path / "bad.gguf", moe_dir("qwen3_moe")[0], "qwen3_moe", expert_count=count,
                      expert_used=used)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory="16MiB")


def test_structured_outputs_on_a_mixture(tmp_path):
    """A mixture with SmolLM2's byte-level tokenizer (what the grammar compiler needs): a regex and a choice hold,
    plainly and under n-gram speculation, with the same text both ways."""
    from conftest import smollm2_path
    from quickdraft.loading.gguf_metadata import read_header

    smollm2 = smollm2_path()
    if smollm2 is None:
        pytest.skip("needs the packaged SmolLM2 (make models)")
    meta = read_header(smollm2).metadata
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.") and not isinstance(v, bool)}
    cls, cfg = FAMILIES["qwen3_moe"]
    cfg = transformers.Qwen3MoeConfig(**{**cfg.to_dict(), "vocab_size": len(meta["tokenizer.ggml.tokens"])})
    torch.manual_seed(0)
    cls(cfg).save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "moe.gguf", tmp_path / "hf", "qwen3_moe", tokenizer=tokenizer)
    texts = {}
    for options in ({}, {"speculative": "ngram"}):
        llm = LLM(str(path), weights="int8", kv_cache_memory="16MiB", **options)
        for name, spec, pattern in (("regex", {"regex": r"[0-9]{3}-(yes|no)"}, r"[0-9]{3}-(yes|no)"),
                                    ("choice", {"choice": ["red", "green"]}, r"red|green")):
            out = llm.generate(["Pick one:"], SamplingParams(max_tokens=16, temperature=0.0,
                                                            structured_outputs=spec))[0]
            assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"
            texts.setdefault(name, set()).add(out.text)
    assert all(len(t) == 1 for t in texts.values())
