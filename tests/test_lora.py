"""LoRA adapters (models/lora.py, loading/lora.py): an adapter's requests get what PEFT's own model of the same
adapter computes, beside the base model's requests and other adapters' in the same batches, over a prefix cache
that never hands one adapter's keys to another, under speculation, on float and quantized base weights; adapters
read from PEFT directories and from llama.cpp's GGUF layout alike; bad adapters and bad names refused by name."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError, ModelLoadError, SessionError
from quickdraft.loading.gguf_metadata import read_header
from quickdraft.loading.lora import read_peft, write_gguf_lora

KV = "8MiB"
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path | torch.nn.Module, out: Path, seed: int, modules: list[str] = ALL_MODULES, r: int = 8,
                 alpha: float = 16, **config) -> Path:
    """A PEFT LoRA of random A and B (``init_lora_weights=False``: B is not zero), saved as PEFT saves it."""
    import peft
    import transformers

    model = base if isinstance(base, torch.nn.Module) else \
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=modules,
                                                         init_lora_weights=False, **config))
    adapted.save_pretrained(out)
    adapted.unload()  # the base model again, unchanged (a shared fixture's model is used by other tests)
    return out


def peft_logprobs(base: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    """PEFT's float32 log-softmax rows of ``ids`` (the base model's where ``adapter`` is None)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def prompt(seed: int, length: int, vocab: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(length)]


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Path:
    return tiny_dir(arch="llama", vocab_size=64, layers=2)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {"all": str(make_adapter(tiny, root / "all", 1)),
            "attn": str(make_adapter(tiny, root / "attn", 2, ["q_proj", "v_proj"], r=4, alpha=32))}


@pytest.fixture(scope="module")
def llm(tiny, adapters) -> LLM:
    return LLM(str(tiny), dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=64, lora_adapters=adapters)


@pytest.mark.parametrize("name", ["all", "attn", None])
def test_each_adapter_computes_what_peft_computes(llm, tiny, adapters, name):
    """Every prompt position's logprob within 2e-4 of PEFT's float32 model, and the greedy tokens PEFT's model
    picks (a 100-token prompt: two 64-token chunks)."""
    ids = prompt(3, 100)
    out = llm.generate([ids], greedy(4, prompt_logprobs=1, lora=name))[0]
    want = peft_logprobs(tiny, None if name is None else Path(adapters[name]), ids)
    for p in range(1, len(ids)):
        assert out.prompt_logprobs[p]["logprob"] == pytest.approx(want[p - 1, ids[p]].item(), abs=2e-4)
    assert out.outputs[0].token_ids[0] == int(want[-1].argmax())


def test_adapters_change_the_output(llm):
    ids = prompt(4, 20)
    outs = [llm.generate([ids], greedy(16, lora=name))[0].outputs[0].token_ids for name in ("all", "attn", None)]
    assert len({tuple(o) for o in outs}) == 3


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_base_and_adapters_in_one_batch_equal_each_alone(llm, temperature):
    """Twelve requests, base and two adapters interleaved (so an adapter's rows are not contiguous), greedy or
    seeded: each one's tokens are those it gets alone."""
    names = ["all", None, "attn", "all", "attn", None] * 2
    params = [SamplingParams(max_tokens=10, temperature=temperature, seed=i, ignore_eos=True, lora=name)
              for i, name in enumerate(names)]
    prompts = [prompt(10 + i, 5 + 3 * i) for i in range(len(names))]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone


def test_the_prefix_cache_never_hands_one_adapters_keys_to_another(tiny, adapters):
    """The same 80-token prompt under one adapter, then the base, then the other adapter: each equals its output in
    a fresh engine, and a repeat under the first adapter reads its own cached blocks."""
    ids = prompt(5, 80)
    order = ["all", None, "attn"]
    shared = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters=adapters)
    runs = [shared.generate([ids], greedy(8, lora=name))[0].outputs[0].token_ids for name in order]
    for name, got in zip(order, runs):
        fresh = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters=adapters)
        assert got == fresh.generate([ids], greedy(8, lora=name))[0].outputs[0].token_ids, name
    allocator = shared.target.allocator
    hits = allocator.prefix_hit_blocks
    assert shared.generate([ids], greedy(8, lora="all"))[0].outputs[0].token_ids == runs[0]
    assert allocator.prefix_hit_blocks > hits


@pytest.mark.parametrize("speculative", ["ngram", "self"])
def test_speculation_keeps_an_adapters_output(llm, tiny, adapters, speculative):
    """Greedy under n-gram drafts and self-drafting (the target's first layer, base weights) equals plain greedy."""
    spec = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters=adapters, speculative=speculative,
               num_speculative_tokens=3, **({"self_draft_layers": 1} if speculative == "self" else {}))
    prompts = [prompt(20 + i, 12) * 3 for i in range(4)]  # repeats, so n-gram drafts are proposed and checked
    params = [greedy(24, lora=name) for name in ("all", "attn", None, "all")]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
           [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_n_samples_and_stream_run_the_adapter(llm):
    ids = prompt(6, 10)
    alone = llm.generate([ids], greedy(8, lora="all"))[0].outputs[0].token_ids
    many = llm.generate([ids], SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True, lora="all"))[0]
    assert [o.token_ids for o in many.outputs] == [alone] * 3
    streamed = [t for chunk in llm.stream(ids, greedy(8, lora="all")) for t in chunk.token_ids]
    assert streamed == alone


def _merged_checkpoint(base: Path, adapters: dict[str, str], scales: dict[str, float], out: Path) -> Path:
    """``base`` with each adapter's B @ A times alpha / r times its scale added into the weights it adapts, saved
    with the base's tokenizer: the reference of a mix of adapters."""
    import shutil

    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    params = dict(model.named_parameters())
    for name, scale in scales.items():
        config = json.loads((Path(adapters[name]) / "adapter_config.json").read_text())
        tensors = load_file(Path(adapters[name]) / "adapter_model.safetensors")
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                with torch.no_grad():
                    params[target] += scale * config["lora_alpha"] / a.shape[0] * (b.double() @ a.double())
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, out / name)
    return out


@pytest.mark.parametrize("scales", [{"all": 0.5}, {"all": 1.0, "attn": -0.7}, {"attn": 2.5, "all": 0.0}])
def test_a_mix_of_adapters_is_the_scaled_sum_of_their_terms(llm, tiny, adapters, tmp_path, scales):
    """llama-server's per-request scales: ``{name: scale}`` runs as the base with every adapter's term times its
    scale merged into its weights (within 2e-4 at every prompt position); scale 0 drops an adapter."""
    ids = prompt(11, 40)
    out = llm.generate([ids], greedy(1, prompt_logprobs=0, lora=scales))[0]
    merged = LLM(str(_merged_checkpoint(tiny, adapters, scales, tmp_path / "merged")), dtype="float32",
                 kv_cache_memory=KV)
    want = merged.generate([ids], greedy(1, prompt_logprobs=0))[0]
    for p in range(1, len(ids)):
        assert out.prompt_logprobs[p]["logprob"] == pytest.approx(want.prompt_logprobs[p]["logprob"], abs=2e-4)
    assert llm.generate([ids], greedy(6, lora={"all": 1}))[0].outputs[0].token_ids == \
           llm.generate([ids], greedy(6, lora="all"))[0].outputs[0].token_ids
    assert llm.generate([ids], greedy(6, lora={"all": 0}))[0].outputs[0].token_ids == \
           llm.generate([ids], greedy(6))[0].outputs[0].token_ids


def test_a_gguf_lora_runs_as_its_peft_source(llm, tiny, adapters, tmp_path):
    """The GGUF llama.cpp's converter writes of a PEFT adapter (write_gguf_lora: the same tensors, q/k's B rows
    permuted as the llama converter permutes them; bench/lora_vs_llamacpp.py runs one on llama-server) runs as the
    PEFT directory does, bit for bit; so does one whose per-module alphas are folded into B (alpha 0)."""
    cfg = llm.model.config
    path = write_gguf_lora(read_peft(Path(adapters["all"]), cfg), tmp_path / "all.gguf", cfg)
    header = read_header(path)
    assert header.metadata["adapter.lora.alpha"] == 16.0 and header.metadata["general.architecture"] == "llama"
    assert "blk.1.ffn_down.weight.lora_b" in {t[0] for t in header.tensors}
    from_gguf = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters={"g": str(path)})
    prompts = [prompt(30 + i, 9) for i in range(3)]
    assert [o.outputs[0].token_ids for o in from_gguf.generate(prompts, greedy(12, lora="g"))] == \
           [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12, lora="all"))]


@pytest.mark.parametrize("config", [{"use_rslora": True}, {"alpha_pattern": {"v_proj": 64}},
                                    {"alpha_pattern": {"self_attn.q_proj": 64, r"layers\.1\.mlp\.down_proj": 2}}])
def test_rslora_and_per_module_alphas_scale_as_peft_does(tiny, tmp_path, config):
    adapter = make_adapter(tiny, tmp_path / "a", 7, **config)
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters={"a": str(adapter)})
    ids = prompt(8, 30)
    out = llm.generate([ids], greedy(1, prompt_logprobs=0, lora="a"))[0]
    want = peft_logprobs(tiny, adapter, ids)
    for p in range(1, len(ids)):
        assert out.prompt_logprobs[p]["logprob"] == pytest.approx(want[p - 1, ids[p]].item(), abs=2e-4)
    # as a GGUF LoRA: one alpha for rsLoRA's alpha / sqrt(r), each module's scale folded into B for alpha_pattern
    cfg = llm.model.config
    path = write_gguf_lora(read_peft(adapter, cfg), tmp_path / "a.gguf", cfg)
    assert (read_header(path).metadata["adapter.lora.alpha"] == 0.0) == ("alpha_pattern" in config)
    gguf_llm = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters={"a": str(path)})
    again = gguf_llm.generate([ids], greedy(1, prompt_logprobs=0, lora="a"))[0]
    for p in range(1, len(ids)):
        assert again.prompt_logprobs[p]["logprob"] == pytest.approx(out.prompt_logprobs[p]["logprob"], abs=1e-5)


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2_transformers, tmp_path_factory) -> Path:
    return make_adapter(smollm2_transformers, tmp_path_factory.mktemp("smollm2") / "a", 9, r=8, alpha=8)


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_an_adapter_on_real_weights(smollm2, smollm2_transformers, smollm2_adapter, weights):
    """SmolLM2 (GQA 9/3 heads, 30 layers) with an adapter on every module. Float32 weights: every prompt position
    within 1e-4 of PEFT's float32 model. The file's own Q8_0 blocks (q/k/v and gate/up one kernel call each,
    gate/up applying SwiGLU in the kernel, bfloat16 activations): the adapter's run is as far from PEFT's as the base
    run is from transformers' (the blocks' rounding, not the adapter, sets it), and beside base requests each
    request gets its tokens alone, bit for bit."""
    import peft

    llm = LLM(str(smollm2), weights=weights, kv_cache_memory="64MiB", lora_adapters={"a": str(smollm2_adapter)})
    ids = llm.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n")
    got = {n: torch.tensor([e["logprob"] for e in llm.generate([ids], greedy(1, prompt_logprobs=0, lora=n))[0]
                            .prompt_logprobs[1:]], dtype=torch.float64) for n in ("a", None)}
    model = peft.PeftModel.from_pretrained(smollm2_transformers, smollm2_adapter).eval()
    try:
        with torch.no_grad():
            rows = {"a": model(torch.tensor([ids])).logits[0]}
            with model.disable_adapter():
                rows[None] = model(torch.tensor([ids])).logits[0]
    finally:
        model.unload()
    want = {n: torch.log_softmax(r.double(), -1)[torch.arange(len(ids) - 1), ids[1:]] for n, r in rows.items()}
    error = {n: (got[n] - want[n]).abs().max().item() for n in got}
    assert (want["a"] - want[None]).abs().max() > 1  # the adapter matters
    if weights == "float32":
        assert max(error.values()) < 1e-4
        return
    assert error["a"] < 1.5 * error[None]
    names = ["a", None, "a", None]
    together = [o.outputs[0].token_ids for o in llm.generate([ids] * 4, [greedy(8, lora=n) for n in names])]
    assert together == [llm.generate([ids], greedy(8, lora=n))[0].outputs[0].token_ids for n in names]


def test_unknown_adapters_are_refused_by_name(llm):
    with pytest.raises(InvalidParameterError, match="'nope' is not an adapter this model serves; it serves 'all', "
                                                    "'attn'"):
        llm.generate([[1, 2]], greedy(2, lora="nope"))
    with pytest.raises(InvalidParameterError, match="'nope' is not an adapter"):
        llm.generate([[1, 2]], greedy(2, lora={"all": 1.0, "nope": 0.5}))
    for bad in ("", 5, "x" * 257, "\ud800", ["all"], {"all": float("nan")}, {"all": 1e38}, {"all": True},
                {"all": 10 ** 400},
                {"all": "1"}, {f"a{i}": 1.0 for i in range(65)}, {"\ud800": 1.0}, {3: 1.0}):
        with pytest.raises(InvalidParameterError, match="lora"):
            SamplingParams(lora=bad)
    assert llm.generate([[1, 2]], greedy(4, lora={}))[0].outputs[0].token_ids == \
           llm.generate([[1, 2]], greedy(4))[0].outputs[0].token_ids  # llama-server's empty list: the base



def test_a_session_keeps_its_first_turns_adapters(llm, tmp_path):
    """A session's turns under an adapter continue from its cache as LLM.generate of the whole history would; a later
    turn may not switch adapters (the cache holds the earlier turns' keys), an all-zero mix is the base, and a
    session that runs adapters is not saved (its snapshot would not say which)."""
    first, second = prompt(50, 10), prompt(51, 6)
    with llm.session() as session:
        one = session.generate(first, greedy(8, lora="all")).outputs[0].token_ids
        two = session.generate(second, greedy(8, lora="all")).outputs[0].token_ids
        assert one == llm.generate([first], greedy(8, lora="all"))[0].outputs[0].token_ids
        assert two == llm.generate([first + one + second], greedy(8, lora="all"))[0].outputs[0].token_ids
        with pytest.raises(InvalidParameterError, match="keeps the LoRA adapters"):
            session.generate([1, 2], greedy(2, lora="attn"))
        with pytest.raises(InvalidParameterError, match="keeps the LoRA adapters"):
            session.generate([1, 2], greedy(2))
        with pytest.raises(SessionError, match="cannot be saved yet"):
            session.save(tmp_path / "s.qds")
    with llm.session() as session:
        assert session.generate([1, 2], greedy(2, lora={"all": 0.0})).outputs[0].token_ids == \
               llm.generate([[1, 2]], greedy(2))[0].outputs[0].token_ids
        session.save(tmp_path / "base.qds")


def _write_peft(directory: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                               **config}))
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


@pytest.mark.parametrize("tensors, config, message", [
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64)}, {}, "needs both lora_A and lora_B"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 63), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)}, {},
     r"lora_A must be \[r, 64\] and lora_B \[64, r\]"),
    ({KEY.format(9, "q_proj", "A"): torch.ones(2, 64), KEY.format(9, "q_proj", "B"): torch.ones(64, 2)}, {},
     "the model has layers 0 to 1"),
    ({KEY.format(0, "q_proj", "A"): torch.full((2, 64), float("nan")), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)},
     {}, "NaN or infinity"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(600, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 600)}, {},
     "r in 1 to 512"),
    ({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 64)}, {}, "LM head adapters are not supported"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)},
     {"use_dora": True}, "DoRA is not supported"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)},
     {"lora_alpha": float("nan")}, "must be numbers"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)},
     {"lora_alpha": 10 ** 400}, "must be numbers"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)},
     {"lora_alpha": 1e300}, "overflows float32"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64), KEY.format(0, "q_proj", "B"): torch.ones(64, 2)},
     {"alpha_pattern": {"q_proj(": 2}}, "not a regular expression"),
    ({KEY.format(0, "q_proj", "A"): torch.ones(2, 64, dtype=torch.int32),
      KEY.format(0, "q_proj", "B"): torch.ones(64, 2, dtype=torch.int32)}, {}, "must be float tensors"),
])
def test_bad_adapters_are_refused_before_loading(tiny, tmp_path, tensors, config, message):
    path = _write_peft(tmp_path / "bad", tensors, **config)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters={"bad": str(path)})


def test_bad_adapter_paths_and_files_are_refused(tiny, tmp_path, smollm2):
    with pytest.raises(ModelLoadError, match="neither is there"):
        LLM(str(tiny), kv_cache_memory=KV, lora_adapters={"a": str(tmp_path / "missing")})
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        LLM(str(tiny), kv_cache_memory=KV, lora_adapters={"a": str(tmp_path / "junk.gguf")})
    with pytest.raises(ModelLoadError, match="not a LoRA adapter"):  # a model, not an adapter
        LLM(str(tiny), kv_cache_memory=KV, lora_adapters={"a": str(smollm2)})
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="pickled adapter_model.bin is not read"):
        LLM(str(tiny), kv_cache_memory=KV, lora_adapters={"a": str(tmp_path / "pickled")})
    for bad in ({"": "x"}, {"a": 5}, ["a"], {f"n{i}": "x" for i in range(65)}):
        with pytest.raises(InvalidParameterError, match="lora_adapters must map"):
            LLM(str(tiny), kv_cache_memory=KV, lora_adapters=bad)


@pytest.fixture(scope="module")
def server(tiny, adapters):
    """vLLM's --lora-modules (all, attn: picked by `model`) and llama-server's --lora-scaled (glob, attn's file at 0.5:
    run by every request that names no adapter)."""
    from quickdraft.serving import create_app
    from test_server import ServerThread

    llm = LLM(str(tiny), dtype="float32", kv_cache_memory=KV, lora_adapters={**adapters, "glob": adapters["attn"]})
    with ServerThread(create_app(llm, "tiny", lora_scales={"glob": 0.5})) as running:
        yield running


def _completion(server, ids: list[int], **body) -> list[int]:
    import httpx
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True, "logprobs": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("t")) if t != "<eos>" else 0 for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_the_server_runs_adapters_as_vllm_and_llama_server_name_them(server, llm):
    """`model` names an adapter (vLLM's, through the official client); a request that names none runs the server's
    --lora adapters at their scales; llama-server's per-request `lora` and POST /lora-adapters set scales."""
    import httpx
    from openai import OpenAI

    ids = prompt(40, 12)
    want = {str(name): llm.generate([ids], greedy(8, lora=name))[0].outputs[0].token_ids
            for name in ("all", None, {"attn": 0.5}, {"attn": 2.0}, {"all": 1.0, "attn": -0.5})}
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    cards = client.models.list().data
    assert [m.id for m in cards] == ["tiny", "all", "attn", "glob"]
    assert [getattr(m, "parent", None) for m in cards] == [None, "tiny", "tiny", "tiny"]
    got = client.completions.create(model="all", prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert [int(t[1:]) for t in got.choices[0].logprobs.tokens] == want["all"] and got.model == "all"
    assert _completion(server, ids, model="tiny") == want[str({"attn": 0.5})]  # the server's default: glob at 0.5
    assert _completion(server, ids, lora=[{"id": 2, "scale": 2.0}]) == want[str({"attn": 2.0})]
    assert _completion(server, ids, lora=[{"id": 0, "scale": 1}, {"id": 1, "scale": -0.5}]) == \
           want[str({"all": 1.0, "attn": -0.5})]
    assert httpx.get(f"{server.url}/lora-adapters").json() == [
        {"id": 0, "name": "all", "path": llm.model.lora.sources[0], "scale": 0.0},
        {"id": 1, "name": "attn", "path": llm.model.lora.sources[1], "scale": 0.0},
        {"id": 2, "name": "glob", "path": llm.model.lora.sources[1], "scale": 0.5}]
    assert httpx.post(f"{server.url}/lora-adapters", json=[{"id": 0, "scale": 1.0}]).json() == {"success": True}
    try:
        assert _completion(server, ids) == want["all"]  # all at 1, glob (left out) at 0
        r = httpx.post(f"{server.url}/completion", json={"prompt": ids, "n_predict": 8, "temperature": 0,
                                                         "ignore_eos": True, "return_tokens": True,
                                                         "lora": [{"id": 1, "scale": 2.0}]})
        assert r.json()["tokens"] == want[str({"attn": 2.0})]
    finally:
        httpx.post(f"{server.url}/lora-adapters", json=[{"id": 2, "scale": 0.5}])
    streamed = client.completions.create(model="all", prompt=ids, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == llm.tokenizer.decode(want["all"])


def test_the_server_refuses_unknown_adapters_and_bad_scales_by_name(server):
    import httpx

    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 404 and "`tiny`, `all`, `attn`, `glob`" in r.json()["error"]["message"]
    for lora in ([{"id": 4, "scale": 1}], [{"id": 0}], [{"id": 0, "scale": 1}, {"id": 0, "scale": 2}], {"id": 0},
                 [{"id": 0, "scale": float("1e300")}], [{"id": True, "scale": 1}], [{"id": 0, "scale": "1"}],
                 [{"id": 0, "scale": 10 ** 400}]):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "lora": lora})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora", (lora, r.text)
        r = httpx.post(f"{server.url}/lora-adapters", json=lora)
        assert r.status_code == 400, (lora, r.text)
    assert httpx.get(f"{server.url}/lora-adapters").json()[2]["scale"] == 0.5  # nothing changed
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "all", "input": "t1 t2"})
    assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "all", "prompt": [1, 2], "max_tokens": 2,
                                                         "lora": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"


def test_an_adapter_may_not_take_the_served_models_name(llm):
    from quickdraft.serving import create_app
    with pytest.raises(ValueError, match="a LoRA adapter is named 'all'"):
        create_app(llm, "all")


def test_the_command_line_takes_adapters_as_llama_cpp_and_vllm_spell_them(tiny, adapters, llm, capsys):
    """`quickdraft generate --lora-scaled PATH:SCALE` runs the adapter at that scale; bad specs exit 2 naming them."""
    from quickdraft import cli

    ids = prompt(41, 6)
    text = " ".join(f"t{i}" for i in ids)
    common = ["generate", str(tiny), text, "--max-tokens", "8", "--max-model-len", "128", "--kv-cache-memory", KV]
    given = ["--lora-scaled", f"{adapters['attn']}:0.5", "--lora-modules", f"x={adapters['all']}"]
    assert cli.main(common + given) == 0
    want = llm.generate([text], SamplingParams(max_tokens=8, temperature=0, lora={"attn": 0.5}))[0].outputs[0].text
    assert capsys.readouterr().out == want + "\n"
    for bad, message in ((["--lora-scaled", f"{adapters['attn']}:abc"], "--lora-scaled takes PATH:SCALE"),
                         (["--lora-modules", "x"], "--lora-modules takes NAME=PATH"),
                         (["--lora-scaled", f"{adapters['attn']}:1e9"], "lora's scale of 'attn'")):
        assert cli.main(common + bad) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lora_kernel_gives_a_row_the_same_bits_in_any_batch(dtype):
    """qd_lora_add: a row's term alone, among 9 rows, or picked by an index is the same bits (torch's float32
    matmul is not: one row takes another kernel than two), and it is scale B (A x) within the output's rounding;
    rows not picked and columns no part covers are untouched. Two adapters on one module (overlapping parts) sum
    into each element in one order, the same on every call on two threads. K and the outputs are not multiples of 8
    (the kernel's tails)."""
    from quickdraft.models import native
    from quickdraft.models.lora import LoraPart, SiteCall

    if not native.available():
        pytest.skip("quickdraft's CPU kernels not built on this CPU")
    torch.manual_seed(0)
    parts = [(LoraPart(0, torch.randn(8, 72), torch.randn(8, 40)), 1.0),
             (LoraPart(45, torch.randn(3, 72), torch.randn(3, 17)), 0.5),
             (LoraPart(3, torch.randn(5, 72), torch.randn(5, 30)), -0.7)]  # overlapping the first
    call = SiteCall(parts)
    x, base = torch.randn(9, 72).to(dtype), torch.randn(9, 64).to(dtype)
    whole = base.clone()
    call.add(whole, x, slice(0, 9))
    for _ in range(50):
        again = base.clone()
        call.add(again, x, slice(0, 9))
        assert torch.equal(again, whole)
    assert torch.equal(whole[:, 40:45], base[:, 40:45]) and torch.equal(whole[:, 62:], base[:, 62:])
    for i in range(9):
        alone = base[i:i + 1].clone()
        call.add(alone, x[i:i + 1], slice(0, 1))
        assert torch.equal(alone[0], whole[i])
    picked = base.clone()
    call.add(picked, x, torch.tensor([8, 2, 5]))
    assert torch.equal(picked[[8, 2, 5]], whole[[8, 2, 5]]) and torch.equal(picked[[0, 1, 3, 4, 6, 7]],
                                                                             base[[0, 1, 3, 4, 6, 7]])
    want = base.double()
    for p, scale in parts:
        want[:, p.offset:p.offset + p.bt.shape[1]] += scale * (x.double() @ p.a.double().T) @ p.bt.double()
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    assert torch.allclose(whole.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize("weights", ["gguf", "int8", "bfloat16"])
def test_fused_layers_add_the_adapters_as_the_module_path_does(smollm2, smollm2_adapter, weights, monkeypatch):
    """A step of single tokens (a verify pass under the adapter beside a base decode token and one at scale -0.5) runs
    the fused C layers with the adapters' terms inside (gate/up that applies SwiGLU taking gate and up in float32 for
    them): the same logits and caches, bit for bit, as the module path, and they run fused."""
    from quickdraft.kv import ForwardItem
    from quickdraft.models.fused import FusedStack
    from quickdraft.models.transformer import DecoderLayer, Transformer

    llm = LLM(str(smollm2), weights=weights, kv_cache_memory="64MiB", lora_adapters={"a": str(smollm2_adapter)})
    runner = llm.target
    prompt_ids = llm.tokenizer.encode("def fibonacci(n):\n    if n")
    stack_calls: list[int] = []
    stack_call = FusedStack.__call__
    monkeypatch.setattr(FusedStack, "__call__", lambda self, *a: (stack_calls.append(1), stack_call(self, *a))[1])

    def step() -> list[torch.Tensor]:
        kvs = [runner.new_kv("a"), runner.new_kv(None), runner.new_kv({"a": -0.5})]
        for kv in kvs:
            runner.forward([ForwardItem(kv, prompt_ids, 1)])
        rows = runner.forward([ForwardItem(kvs[0], [29, 308, 4811], 3), ForwardItem(kvs[1], [29], 1),
                               ForwardItem(kvs[2], [476, 44], 2)])
        caches = [runner.gather(kv)["k"] for kv in kvs] + [runner.gather(kv)["v"] for kv in kvs]
        for kv in kvs:
            runner.free(kv)
        return [*rows, *caches]

    fused = step()
    assert stack_calls
    monkeypatch.setattr(DecoderLayer, "fused", lambda self, rope: None)
    monkeypatch.setattr(Transformer, "fused_stack", lambda self, n: None)
    for a, b in zip(fused, step()):
        assert torch.equal(a, b)
