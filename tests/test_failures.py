"""One request's failure is its own: an error raised while processing one sequence ends that request alone, and
every other sequence of the same batched speculative step finishes with exactly the tokens it has alone."""
from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError, RequestFailedError
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.sampling import LogitsProcessor

try:
    from conftest import make_tiny_checkpoint, write_word_tokenizer
    from test_speculative import tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.conftest import make_tiny_checkpoint, write_word_tokenizer
    from tests.test_speculative import tiny_prompts

PROMPTS = tiny_prompts(64, 3)
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)]  # seeded: reproducible too


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    """A draft model with a fixed k: every step drafts for the whole batch in one batched draft pass."""
    target = tiny_dir(arch="qwen2", vocab_size=64, layers=2)
    draft = tiny_dir(arch="llama", vocab_size=64, seed=3)
    return LLM(str(target), draft=str(draft), dtype="float32", draft_weights="float32", num_speculative_tokens=3,
               kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    return [llm.generate([p], params)[0].token_ids for p, params in zip(PROMPTS, PARAMS)]


def run_batch(llm: LLM, break_one) -> list:
    """Queue the three prompts, let ``break_one(sequence)`` sabotage the second once it has prefilled, run to the end."""
    engine = llm.engine
    rids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS)]
    engine.step()  # the prompts
    break_one(engine.sequences(rids[1])[0])
    while engine.has_unfinished():
        engine.step()
    seqs = [engine.sequences(rid)[0] for rid in rids]
    for rid in rids:
        engine.release(rid)
    return seqs


def sabotage(obj, name: str, after_calls: int) -> None:
    """Make ``obj.name`` raise from its (after_calls + 1)-th call on."""
    real = getattr(obj, name)
    count = {"n": 0}

    def failing(*args, **kwargs):
        count["n"] += 1
        if count["n"] > after_calls:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)
    setattr(obj, name, failing)


@pytest.mark.parametrize("where", ["sampling", "detokenizer"])
def test_a_failing_sequence_ends_its_request_alone(llm, alone, where):
    def break_one(seq) -> None:
        if where == "sampling":  # the target's transforms at the commit (the drafter's q goes through it too)
            sabotage(seq.processor, "process", after_calls=6)
        else:
            sabotage(seq.detokenizer, "add", after_calls=5)

    seqs = run_batch(llm, break_one)
    assert [s.output_ids for s in (seqs[0], seqs[2])] == [alone[0], alone[2]]
    assert [s.finish_reason for s in seqs] == ["length", "error", "length"]
    broken = seqs[1]
    assert "injected failure" in broken.error and broken.output_ids == alone[1][:len(broken.output_ids)]
    assert llm.engine.stats.draft_tokens > 0
    assert llm.target.allocator.num_used == 0 and llm.drafter.runner.allocator.num_used == 0


def test_logits_that_are_no_distribution_end_that_request_alone(llm, alone):
    """The decisions are made on the device and read back once, so a NaN cannot raise where it arises: it is
    flagged with the tokens and ends its own request there, with the message of the host check."""
    engine = llm.engine
    rids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS)]
    engine.step()
    sampled = engine.sequences(rids[2])[0]
    real = sampled.processor.process
    sampled.processor.process = lambda logits, *a, **kw: torch.full_like(real(logits, *a, **kw), float("nan"))
    while engine.has_unfinished():
        engine.step()
    seqs = [engine.sequences(rid)[0] for rid in rids]
    for rid in rids:
        engine.release(rid)
    assert [s.output_ids for s in seqs[:2]] == alone[:2]
    assert [s.finish_reason for s in seqs] == ["length", "length", "error"]
    assert "probabilities must be finite" in seqs[2].error
    assert llm.target.allocator.num_used == 0 and llm.drafter.runner.allocator.num_used == 0


def test_a_failing_drafter_degrades_that_sequence_to_plain_decoding(llm, alone, monkeypatch):
    real = llm.drafter.propose
    broken: list = []

    def propose(seqs, ks):
        if any(s in broken for s in seqs):
            raise RuntimeError("injected drafter failure")
        return real(seqs, ks)
    monkeypatch.setattr(llm.drafter, "propose", propose)
    seqs = run_batch(llm, broken.append)
    assert [s.output_ids for s in seqs] == alone  # speculation is exact: plain decoding gives the same tokens
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert seqs[1].spec.draft_failed and not seqs[0].spec.draft_failed
    drafted_before = 3  # the prompt step drafted k tokens for every sequence, before the sabotage
    assert seqs[1].metrics.spec.draft_tokens == drafted_before < seqs[0].metrics.spec.draft_tokens
    assert llm.target.allocator.num_used == 0 and llm.drafter.runner.allocator.num_used == 0


def test_generate_raises_with_every_output_kept(llm, alone, monkeypatch):
    real = LogitsProcessor.process

    def process(self, logits, *args, **kwargs):
        if self._prompt_ids == PROMPTS[1] and len(self._output_ids) >= 4:
            raise RuntimeError("injected failure")
        return real(self, logits, *args, **kwargs)
    monkeypatch.setattr(LogitsProcessor, "process", process)
    with pytest.raises(RequestFailedError, match="1 of 3 requests failed .*injected failure") as info:
        llm.generate(PROMPTS, PARAMS)
    outputs = info.value.outputs
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert [outputs[0].token_ids, outputs[2].token_ids] == [alone[0], alone[2]]
    assert "injected failure" in outputs[1].outputs[0].error
    monkeypatch.undo()
    with pytest.raises(RequestFailedError, match="injected failure"):
        monkeypatch.setattr(LogitsProcessor, "process", process)
        list(llm.stream(PROMPTS[1], PARAMS[1]))
    assert llm.target.allocator.num_used == 0


# ---- padding rows --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> str:
    """A checkpoint whose embedding has 8 rows more than its tokenizer has tokens (as Qwen2.5's does)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("padded") / "m", arch="qwen2", vocab_size=72, layers=2)
    write_word_tokenizer(path, 64)
    return str(path)


def prefer_padding(runner) -> None:
    """Make every padding column the largest logit by far, as if the model preferred padding rows."""
    real = runner.forward

    def forward(items):
        rows = [r.clone() for r in real(items)]  # inference tensors: edit copies
        for r in rows:
            r[:, 64:] = 1e4
        return rows
    runner.forward = forward


@pytest.mark.parametrize("speculative", [None, "draft"])
def test_padding_rows_are_never_sampled_or_drafted(padded, tiny_dir, speculative):
    kwargs = {} if speculative is None else {"draft": padded, "draft_weights": "float32", "num_speculative_tokens": 3}
    llm = LLM(padded, dtype="float32", kv_cache_memory="8MiB", **kwargs)
    assert llm.engine.vocab_size == 64 and llm.model.config.vocab_size == 72
    params = [SamplingParams(max_tokens=16, temperature=t, seed=5, ignore_eos=True) for t in (0.0, 1.0)]
    before = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    prefer_padding(llm.target)
    if speculative:
        prefer_padding(llm.drafter.runner)
    after = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert after == before and max(max(ids) for ids in after) < 64
    with pytest.raises(InvalidParameterError, match=r"logit_bias key must be a token id in \[0, 64\), got 70"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={70: 100}))
    with pytest.raises(InvalidParameterError, match=r"prompt token ids must be in \[0, 64\)"):
        llm.generate([[1, 2, 70]], SamplingParams())
    if speculative:
        assert llm.engine.stats.draft_tokens > 0


def test_target_logits_come_out_with_padding_masked(padded):
    """The target's padding columns are -inf as they leave the runner, so the sampler copies no row to mask them."""
    llm = LLM(padded, dtype="float32", kv_cache_memory="8MiB")
    kv = SequenceKV()
    (rows,) = llm.target.forward([ForwardItem(kv, [1, 2, 3], 1)])
    llm.target.free(kv)
    assert torch.isneginf(rows[:, 64:]).all() and torch.isfinite(rows[:, :64]).all()
    processed = LogitsProcessor(SamplingParams(temperature=0.0), [1, 2, 3], 64).process(rows)
    assert processed.data_ptr() == rows.data_ptr()
