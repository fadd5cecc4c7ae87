"""The CUDA path (``device="cuda"``: float weights; decode and verify forwards replay CUDA graphs captured at load, with
the Triton paged attention kernel; prompt chunks run the same kernels eagerly), where a GPU is present (skipped elsewhere,
e.g. on CI): graph replay gives the eager static step's logits bit for bit at every bucket, greedy speculation gives
plain greedy's tokens, batching changes no sequence's tokens, a seeded request repeats, and a float32 model gives the
CPU's tokens. Real weights: $QUICKDRAFT_TEST_GGUF or the packaged SmolLM2. bench/gpu_check.sh runs this file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.kv import ForwardItem, SequenceKV

try:
    from conftest import smollm2_path
    from test_speculative import tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.conftest import smollm2_path
    from tests.test_speculative import tiny_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
TINY_KV, REAL_KV = "16MiB", "256MiB"
REAL_PROMPTS = ["Write a Python function that checks whether a number is prime.",
                "Summarise: The cat sat on the mat. The cat sat on the mat because the mat was warm.",
                "What is the capital of France? Answer in one sentence."]


@pytest.fixture(scope="module")
def target(tiny_dir) -> str:
    return str(tiny_dir(arch="qwen2", vocab_size=64, layers=4))


@pytest.fixture(scope="module")
def draft(tiny_dir) -> str:
    return str(tiny_dir(arch="llama", vocab_size=64, seed=3))


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    return LLM(target, dtype="float32", device="cuda", kv_cache_memory=TINY_KV)


@pytest.fixture(scope="module")
def plain_greedy(plain) -> list[list[int]]:
    return [o.token_ids for o in plain.generate(tiny_prompts(64, 6), GREEDY)]


def test_runs_on_the_gpu(plain, plain_greedy):
    assert plain.device == "cuda" and plain.target.pool.k.is_cuda
    assert all(p.is_cuda for p in plain.model.parameters())
    assert [len(t) for t in plain_greedy] == [GREEDY.max_tokens] * 6


def test_graphs_are_captured_at_load_and_replayed(plain):
    static = plain.target.static
    assert static.graphs and static.captured == len(static.seq_sizes) * len(static.query_sizes)
    assert static.captured_chunks == 10  # one sequence's prompt chunk buckets: 1, 2, 4, ... 512 rows
    before = static.replays
    plain.generate(tiny_prompts(64, 3), GREEDY)
    assert static.replays >= before + GREEDY.max_tokens - 1  # every decode step after the prompt


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_at_every_bucket(tiny_dir, dtype, kv_dtype):
    """1..16 sequences x 1..9 queries (padding sequences, padding rows, sequences of fewer queries than the bucket):
    the replayed graph's logits are the eager static step's, bit for bit."""
    model = str(tiny_dir(arch="qwen2", vocab_size=64, layers=4, hidden=128))  # head_dim 32: int8 takes it
    llms = {mode: LLM(model, dtype=dtype, device="cuda", kv_cache_memory=TINY_KV, kv_cache_dtype=kv_dtype,
                      static_step=mode) for mode in ("graphs", "eager")}
    prompts = tiny_prompts(64, 16, length=20)
    for seqs in (1, 2, 3, 5, 8, 16):
        for queries in (1, 2, 3, 5, 9):
            out = {}
            for mode, llm in llms.items():
                runner = llm.target
                kvs = [SequenceKV() for _ in range(seqs)]
                runner.forward([ForwardItem(kv, p, 1) for kv, p in zip(kvs, prompts)])
                new = [[(b + j) % 63 + 1 for j in range(max(1, queries - b % 2))] for b in range(seqs)]
                out[mode] = torch.cat(runner.forward([ForwardItem(kv, t, len(t)) for kv, t in zip(kvs, new)]))
                for kv in kvs:
                    runner.free(kv)
            assert torch.equal(out["graphs"], out["eager"]), (seqs, queries)
    assert llms["graphs"].target.static.replays == 30 and llms["eager"].target.static.forwards == 30


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_chunk_graphs_equal_eager_chunks(tiny_dir, dtype):
    """Prompt chunks replay their bucket's graph (one sequence's captured at load, several sequences' on first use):
    the logits of each chunk's last rows (none, one, several) and the decode step after them, whose keys the chunks
    wrote, are the eager chunks' bit for bit."""
    model = str(tiny_dir(arch="qwen2", vocab_size=64, layers=4, hidden=128))
    llms = {mode: LLM(model, dtype=dtype, device="cuda", kv_cache_memory=TINY_KV, static_step=mode)
            for mode in ("graphs", "eager")}
    prompts = tiny_prompts(64, 3, length=100)
    steps = [[(prompts[0][:5], 1)], [(prompts[0][:37], 0)], [(prompts[0][:100], 3)],
             [(prompts[0][:17], 1), (prompts[1][:30], 2), (prompts[2][:20], 0)]]
    for chunks in steps:
        out = {}
        for mode, llm in llms.items():
            runner = llm.target
            kvs = [SequenceKV() for _ in chunks]
            rows = runner.forward([ForwardItem(kv, p, n) for kv, (p, n) in zip(kvs, chunks)])
            rows += runner.forward([ForwardItem(kv, [7], 1) for kv in kvs])
            out[mode] = torch.cat(rows)
            for kv in kvs:
                runner.free(kv)
        assert torch.equal(out["graphs"], out["eager"]), [len(p) for p, _ in chunks]
    static = llms["graphs"].target.static
    assert static.chunk_forwards == len(steps) and static.captured_chunks == 11  # the 3-sequence bucket added


@pytest.mark.parametrize("options", [{}, {"speculative": "ngram", "num_speculative_tokens": 3},
                                     {"speculative": "self", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram", "self"])
def test_graphs_give_the_eager_steps_tokens(target, options):
    """Greedy and seeded sampling: graphs, the eager static step and the dynamic path (float32) give the same tokens."""
    prompts = tiny_prompts(64, 6)
    sampled = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    runs = {mode: LLM(target, dtype="float32", device="cuda", kv_cache_memory=TINY_KV, static_step=mode, **options)
            for mode in ("graphs", "eager", "off")}
    for params in (GREEDY, sampled):
        tokens = {mode: [o.token_ids for o in llm.generate(prompts, params)] for mode, llm in runs.items()}
        assert tokens["graphs"] == tokens["eager"] == tokens["off"]
    assert runs["graphs"].target.static.replays > 0


@pytest.mark.parametrize("kind", ["ngram", "self", "draft", "draft-same"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_speculation_equals_plain(target, draft, plain_greedy, kind, k):
    kwargs = {"speculative": kind} if kind in ("ngram", "self") else {"draft": target if kind == "draft-same" else draft}
    llm = LLM(target, dtype="float32", device="cuda", kv_cache_memory=TINY_KV, num_speculative_tokens=k, **kwargs)
    assert [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)] == plain_greedy
    stats = llm.spec_stats
    if k == 3:
        assert stats.draft_tokens > 0
    if kind == "draft-same" and stats.draft_tokens:  # the verify pass computes the draft's own logits
        assert stats.acceptance_rate > 0.95


def test_a_graphs_device_time_is_timed_on_the_scratch_block(plain, plain_greedy):
    """Timing a bucket's graph between a live sequence's steps leaves every block but the scratch one as it was."""
    runner, static = plain.target, plain.target.static
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, tiny_prompts(64, 1)[0], 1)])
    runner.forward([ForwardItem(kv, [3], 1)])
    before = {name: plane.clone() for name, plane in runner.pool.planes.items()}
    assert 0 < static.device_seconds(1, 1, runner.logit_columns) < 0.1
    assert 0 < static.device_seconds(4, 3, runner.logit_columns) < 0.1
    scratch = slice(static.scratch_slot, static.scratch_slot + runner.block_size)
    with torch.inference_mode():  # (the pool may hold inference tensors)
        for name, plane in runner.pool.planes.items():
            after = plane.clone()
            after[:, scratch], before[name][:, scratch] = 0, 0
            assert torch.equal(after, before[name]), name
    runner.free(kv)
    assert [o.token_ids for o in plain.generate(tiny_prompts(64, 6), GREEDY)] == plain_greedy


def test_batch_equals_each_alone(plain, plain_greedy):
    alone = [plain.generate([p], GREEDY)[0].token_ids for p in tiny_prompts(64, 6)]
    assert alone == plain_greedy


@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_seeded_sampling_repeats_and_matches_cpu(target, draft, kind):
    """The engine's generators live on the CPU, where the draws are made: the same seed gives the same tokens on
    CUDA twice, and (float32 everywhere, the draft too: its q decides acceptance) the CPU's tokens."""
    kwargs = {} if kind == "plain" else {"draft": draft, "num_speculative_tokens": 3, "draft_weights": "float32"}
    prompts = tiny_prompts(64, 3)

    def run(device: str, seed: int = 1234) -> list[list[int]]:
        llm = LLM(target, dtype="float32", device=device, kv_cache_memory=TINY_KV, **kwargs)
        params = SamplingParams(max_tokens=32, temperature=0.9, seed=seed, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params)]

    first = run("cuda")
    assert run("cuda") == first
    assert run("cpu") == first
    assert run("cuda", seed=99) != first


DECISION_PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, logit_bias={7: 2.0}, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.1, presence_penalty=0.5, frequency_penalty=0.3, seed=6,
                   ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.3, seed=7,
                   ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, mirostat=1, mirostat_tau=3.0, seed=8, ignore_eos=True)]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_a_steps_decisions_come_back_in_one_copy(target, draft, kind, monkeypatch):
    """Greedy choices, penalties, bias, truncation, acceptance tests and residual draws of a whole step run on the
    GPU: torch's sync checker sees exactly one wait for the device while the step decides (the copy of the
    decisions to the host), and the tokens are the CPU's."""
    import warnings

    import quickdraft.engine.engine as engine_module
    real = engine_module.decide
    syncs: list[int] = []
    places: list[list[str]] = []  # where each step waited, for the failure's message

    def counting(picked, isolated):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                decided = real(picked, isolated)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        syncs.append(len(waits))
        places.append(waits)
        return decided

    options = {"num_speculative_tokens": 3} | (
        {"speculative": "ngram"} if kind == "ngram" else {"draft": draft, "draft_weights": "float32"})
    prompts = tiny_prompts(64, len(DECISION_PARAMS))

    def run(device: str) -> list[list[int]]:
        llm = LLM(target, dtype="float32", device=device, kv_cache_memory=TINY_KV, **options)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, DECISION_PARAMS)]

    cpu = run("cpu")
    monkeypatch.setattr(engine_module, "decide", counting)
    assert run("cuda") == cpu
    # the first step may wait once more: on an H200 (torch 2.11) the extra wait surfaced at set_sync_debug_mode's
    # own line, a warning raised outside any call of the step (a first allocation's), never in a later step
    assert len(syncs) > 1 and syncs[0] in (1, 2) and set(syncs[1:]) == {1}, [p for p in places if len(p) != 1][:3]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_weight_only_int8_and_int4_run_on_tritons_kernel(target, weights):
    """Quantized linears on the GPU run Triton's kernel (no float copy of a weight): inside the graphs, the tokens
    of the same step run eagerly, and greedy n-gram speculation gives plain greedy's tokens. (Against the dynamic
    path, whose attention is another kernel, a bfloat16 near-tie may flip: seen at token 25 on an H200.)"""
    from quickdraft.models.quant import Int4Linear, Int8Linear
    from quickdraft.models.triton_linear import GatedProjection

    prompts = tiny_prompts(64, 4)

    def run(**options) -> tuple[list[list[int]], LLM]:
        llm = LLM(target, dtype="float32", device="cuda", weights=weights, kv_cache_memory=TINY_KV, **options)
        return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm

    graphs, llm = run()
    layers = [m for m in llm.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert layers and {m.backend for m in layers} == {"triton"}
    assert all(layer.self_attn.qkv_proj is not None for layer in llm.model.model.layers)  # q/k/v as one call
    assert all(isinstance(layer.mlp.gate_up_proj, GatedProjection) for layer in llm.model.model.layers)  # SwiGLU in it
    assert llm.target.static.replays > 0
    # the load chose its tiles on the graphs (every group of a tiny model runs a program or two): each trial kept
    # the bits or was passed over, and the eager step (no tuning: the default tiles) gives the same tokens
    tuning = llm.target.tile_tuning
    assert len(tuning) > 2 and "error" not in tuning[0] and tuning[-1]["seconds"] > 0, tuning[:2]
    assert run(static_step="eager")[0] == graphs
    assert run(speculative="ngram", num_speculative_tokens=3)[0] == graphs


def test_quantizing_on_the_gpu_gives_the_cpus_bits():
    """int8 and int4 weights are quantized on the device they run on at load: the bits of the CPU's quantizer."""
    from quickdraft.models.quant_formats import quantize_int4, quantize_int8

    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, :64] = 0.0  # a constant group
    for quantize in (quantize_int8, quantize_int4):
        on_gpu, on_cpu = quantize(w.cuda()), quantize(w)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu, on_cpu)), quantize.__name__


def test_bfloat16_linears_on_tritons_kernel(target, draft):
    """``gpu_linears='triton'``: the decoder layers' bfloat16 linears run Triton's kernel, inside the graphs too,
    gate/up with its SwiGLU in the kernel; the eager step gives the graphs' tokens, and greedy speculation (n-gram, a
    draft model) plain greedy's."""
    from quickdraft.models.triton_linear import GatedProjection, TritonLinear

    prompts = tiny_prompts(64, 4)

    def run(**options) -> tuple[list[list[int]], LLM]:
        llm = LLM(target, dtype="bfloat16", device="cuda", kv_cache_memory=TINY_KV, gpu_linears="triton", **options)
        return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm

    graphs, llm = run()
    layer = llm.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, TritonLinear) and isinstance(layer.mlp.down_proj, TritonLinear)
    assert isinstance(layer.mlp.gate_up_proj, GatedProjection) and layer.mlp.activated
    assert llm.target.static.replays > 0
    assert run(static_step="eager")[0] == graphs
    assert run(speculative="ngram", num_speculative_tokens=3)[0] == graphs
    assert run(draft=draft)[0] == graphs


def test_float32_cuda_matches_cpu(target, plain_greedy):
    cpu = LLM(target, dtype="float32", device="cpu", kv_cache_memory=TINY_KV)
    assert [o.token_ids for o in cpu.generate(tiny_prompts(64, 6), GREEDY)] == plain_greedy
    prompt = tiny_prompts(64, 1, length=60)[0]  # a prompt piece (causal SDPA) and single tokens
    cuda = LLM(target, dtype="float32", device="cuda", kv_cache_memory=TINY_KV)
    a, b = (llm.target.forward([ForwardItem(SequenceKV(), prompt, len(prompt))])[0].cpu() for llm in (cpu, cuda))
    diff = (a - b).abs().max().item()
    print(f"float32 logits, max |cpu - cuda| = {diff:.3g} (logits up to {a.abs().max().item():.3g})")
    assert diff < 1e-3


@pytest.fixture(scope="module")
def real() -> Path:
    path = os.environ.get("QUICKDRAFT_TEST_GGUF") or smollm2_path()
    if not path or not Path(path).exists():
        pytest.skip("no real weights ($QUICKDRAFT_TEST_GGUF or make models)")
    return Path(path)


@pytest.fixture(scope="module")
def real_plain(real) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(real), device="cuda", kv_cache_memory=REAL_KV)  # float weights, bfloat16 on CUDA
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in REAL_PROMPTS]
    return prompts, [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "self", "draft"])
def test_real_weights_greedy_speculation_equals_plain(real, real_plain, kind):
    prompts, plain = real_plain
    kwargs = {"speculative": kind} if kind != "draft" else {"draft": str(real), "num_speculative_tokens": 3}
    llm = LLM(str(real), device="cuda", kv_cache_memory=REAL_KV, **kwargs)
    spec = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))]
    same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(plain, spec)]
    print(f"{kind}: tokens equal to plain before the first difference: {same} of {[len(p) for p in plain]}")
    assert spec == plain
    assert llm.spec_stats.draft_tokens > 0


def verify_equals_steps(llm: LLM, prompt: list[int], tokens: list[int]) -> None:
    """The invariant greedy speculation rests on (test_speculative.py checks it on CPU): k tokens verified in one pass
    get the logits of k one-token steps, alone or batched beside other sequences."""
    runner, kv_a, kv_b, others = llm.target, SequenceKV(), SequenceKV(), [SequenceKV() for _ in range(9)]
    runner.forward([ForwardItem(kv_a, prompt, 1)])
    runner.forward([ForwardItem(kv_b, prompt, 1)])
    runner.forward([ForwardItem(kv, prompt[:3 + i], 1) for i, kv in enumerate(others)])
    (verified,) = runner.forward([ForwardItem(kv_a, tokens, len(tokens))])
    stepped, batched = [], []
    for t in tokens:
        stepped.append(runner.forward([ForwardItem(kv_b, [t], 1)])[0])
        runner.truncate(kv_b, kv_b.num_cached - 1)
        batched.append(runner.forward([ForwardItem(kv_b, [t], 1)] + [ForwardItem(kv, [t], 1) for kv in others])[0])
    stepped, batched = torch.cat(stepped), torch.cat(batched)
    print(f"{llm.weights}: max |verify - step| = {(verified - stepped).abs().max().item():.3g}, "
          f"max |verify - batched| = {(verified - batched).abs().max().item():.3g}")
    assert torch.equal(verified, stepped) and torch.equal(verified, batched)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_pass_equals_single_steps(target, dtype):
    llm = LLM(target, dtype=dtype, device="cuda", kv_cache_memory=TINY_KV)
    verify_equals_steps(llm, tiny_prompts(64, 1)[0][:12], [3, 9, 17, 25, 33, 41])


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bfloat16", "float32"])
def test_real_weights_verify_pass_equals_single_steps(real, weights):
    llm = LLM(str(real), device="cuda", weights=weights, kv_cache_memory=REAL_KV)
    verify_equals_steps(llm, llm.tokenizer.encode("def fibonacci(n):\n    if n"), [29, 308, 4811, 28, 476, 44])


@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_int8_cache_greedy_speculation_equals_plain(tiny_dir, kind):
    """An int8 KV cache on the GPU (torch's quantizer and dequantized reads): speculation stays exact within it."""
    model = str(tiny_dir(arch="qwen2", vocab_size=64, layers=4, hidden=128))  # head_dim 32: one scale per head row
    prompts = tiny_prompts(64, 6)
    plain = LLM(model, dtype="float32", device="cuda", kv_cache_memory=TINY_KV, kv_cache_dtype="int8")
    assert plain.target.pool.k.dtype == torch.int8 and plain.target.pool.k.is_cuda
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    spec = LLM(model, dtype="float32", device="cuda", kv_cache_memory=TINY_KV, kv_cache_dtype="int8",
               speculative=kind, num_speculative_tokens=3)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == expected


def test_a_draft_with_a_cut_head_replays_its_own_graphs(target):
    """A draft whose lm_head keeps fewer rows than its vocabulary (draft_vocab) captures graphs of that width."""
    llm = LLM(target, dtype="float32", device="cuda", kv_cache_memory=TINY_KV, draft=target, draft_vocab=40,
              num_speculative_tokens=3)
    prompts = tiny_prompts(64, 3)
    assert len(llm.generate(prompts, GREEDY)) == 3
    assert llm.loaded.engine.drafter.runner.static.replays > 0


def test_a_draft_steps_tokens_come_back_in_one_copy():
    """A draft model's step decides every sequence's token on the GPU (greedy rows and drawn ones) and reads them
    back in one copy; the tokens are the CPU's."""
    import warnings

    from quickdraft.speculative.drafters import draft_tokens

    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)).cuda()
    uniforms = [None, 0.3, None, 0.7, 0.1, None]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tokens, _ = draft_tokens(logits, uniforms)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) == 1
    assert tokens == draft_tokens(logits.cpu(), uniforms)[0]


LAUNCH_AHEAD_PARAMS = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                       SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                       SamplingParams(max_tokens=30, temperature=0.8, top_k=20, min_p=0.05, seed=5, ignore_eos=True),
                       SamplingParams(max_tokens=19, temperature=1.1, top_p=0.8, seed=6, ignore_eos=True),
                       SamplingParams(max_tokens=30, temperature=0.0, n=2, ignore_eos=True)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_ahead_gives_the_same_tokens(target, dtype):
    """Replayed graphs launch each decode step before the previous one's tokens are read (on by default): greedy and
    seeded sampling, sequences ending at different steps, give the tokens of the same graphs without it."""
    prompts = tiny_prompts(64, len(LAUNCH_AHEAD_PARAMS))
    runs = {}
    for ahead in ("auto", "off"):
        llm = LLM(target, dtype=dtype, device="cuda", kv_cache_memory=TINY_KV, launch_ahead=ahead)
        runs[ahead] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, LAUNCH_AHEAD_PARAMS)]
        assert (llm.loaded.engine.ahead.launches > 0) == (ahead == "auto")
    assert runs["auto"] == runs["off"]


def test_a_step_is_read_while_the_next_runs(plain, plain_greedy, monkeypatch):
    """The point of launching ahead: each step's tokens reach the host while the device still runs the next step.
    The next forward is held back on the device (a sleep kernel queued before it); every commit of a step whose
    successor was launched must find the device still busy, and the tokens must not change."""
    engine = plain.loaded.engine
    runner = engine.target
    forward, commit = runner.forward, engine._commit
    busy: list[bool] = []

    def slow_forward(items, device_tokens=None, wait=True):
        if device_tokens is not None:
            torch.cuda._sleep(20_000_000)  # about 10 ms of the device's time before the launched step
        return forward(items, device_tokens, wait)

    def watching_commit(seq, rows, proposal, accepted, token, cached_ahead=0):
        if cached_ahead:
            busy.append(not torch.cuda.current_stream().query())
        return commit(seq, rows, proposal, accepted, token, cached_ahead)

    monkeypatch.setattr(runner, "forward", slow_forward)
    monkeypatch.setattr(engine, "_commit", watching_commit)
    assert [o.token_ids for o in plain.generate(tiny_prompts(64, 6), GREEDY)] == plain_greedy
    assert len(busy) > 30 and all(busy)


def test_prompt_logprobs_on_the_gpu(plain, target):
    """Prompt logprobs where prompt chunks run on the static step's kernels (a GPU's default): the CPU's float32 values
    within rounding, and whether each position equals its logprob as the last prompt token sampled there, bit for
    bit as on the CPU (the head runs over 256 prompt rows at once there, over the rows that want logits here)."""
    ids = tiny_prompts(64, 1, length=150)[0]
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    gpu = plain.generate([ids], params)[0].prompt_logprobs
    cpu = LLM(target, dtype="float32", kv_cache_memory=TINY_KV).generate([ids], params)[0].prompt_logprobs
    assert len(gpu) == len(ids) and gpu[0] is None
    for a, b in zip(gpu[1:], cpu[1:]):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
    positions = [1, 64, 65, 149]
    forced = plain.generate([ids[:p] for p in positions],
                            [SamplingParams(max_tokens=1, temperature=0, logprobs=3, allowed_token_ids=[ids[p]])
                             for p in positions])
    same = [out.outputs[0].logprobs[0] == gpu[p] for p, out in zip(positions, forced)]
    assert all(same), f"positions whose scored logprob differs from the sampled one: {same}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_adapters_on_the_gpu(target, tmp_path, dtype):
    """An adapter's requests beside base ones on the GPU: the base requests' tokens are those they get alone (their
    rows keep the static step's graphs: the adapters' rows take a forward of their own), and in float32 an adapter's
    prompt logprobs are the CPU's within rounding (its terms are torch's matmuls there, whose rounding may follow
    the batch: its tokens are not compared bit for bit)."""
    from test_lora import KEY, _write_peft  # (the GPU image has no peft: the adapter's files written directly)

    torch.manual_seed(1)
    hidden, kv = 64, 32  # the tiny target's q and k/v widths (4 heads, 2 kv heads of 16)
    tensors = {}
    for layer in range(4):
        for module, width in (("q_proj", hidden), ("v_proj", kv), ("o_proj", hidden)):
            tensors[KEY.format(layer, module, "A")] = torch.randn(2, hidden) * 0.3
            tensors[KEY.format(layer, module, "B")] = torch.randn(width, 2) * 0.3
    adapter = str(_write_peft(tmp_path / "a", tensors))
    gpu = LLM(target, dtype=dtype, device="cuda", kv_cache_memory=TINY_KV, lora_adapters={"a": adapter})
    prompts = tiny_prompts(64, 4)
    names = ["a", None, {"a": 0.5}, None]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, lora=n) for n in names]
    together = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    base = [i for i, n in enumerate(names) if n is None]
    assert [together[i] for i in base] == [gpu.generate([prompts[i]], params[i])[0].outputs[0].token_ids for i in base]
    if dtype == "float32":
        scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, lora="a")
        cpu = LLM(target, dtype="float32", kv_cache_memory=TINY_KV, lora_adapters={"a": adapter})
        a, b = (llm.generate([prompts[0]], scored)[0].prompt_logprobs[1:] for llm in (gpu, cpu))
        assert all(x["logprob"] == pytest.approx(y["logprob"], abs=1e-3) for x, y in zip(a, b))
