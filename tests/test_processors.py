import math

import pytest
import torch
from scipy import stats

from quickdraft.sampling import LogitsProcessor, SamplingParams, greedy, make_generator, sample, top_logprobs

NEG_INF = float("-inf")


def proc(prompt=(), vocab=None, outputs=(), **kw):
    params = SamplingParams(**kw)
    lp = LogitsProcessor(params, list(prompt), vocab if vocab is not None else 8)
    lp.accept(list(outputs))
    return lp


def T(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def kept(x):
    return set(torch.nonzero(torch.isfinite(x.reshape(-1))).reshape(-1).tolist())


# ------------------------------------------------------------------ fast path
def test_fast_path_temperature_only():
    x = T([1.0, -2.0, 4.0])
    assert torch.equal(proc(temperature=2.0).process(x), T([0.5, -1.0, 2.0]))
    assert torch.equal(proc(temperature=1.0).process(x), x)
    bf = x.to(torch.bfloat16)
    out = proc(temperature=0.5).process(bf)
    assert out.dtype == torch.float32 and torch.equal(out, T([2.0, -4.0, 8.0]))
    # 1-D input gives 1-D output
    assert proc(temperature=2.0).process(x[0]).shape == (3,)


def test_input_never_modified():
    x = T([1.0, 2.0, -3.0, 0.5], [0.0, 1.0, 2.0, 3.0])
    orig = x.clone()
    lp = proc(prompt=[0], outputs=[2], logit_bias={1: 3.0}, repetition_penalty=1.5, frequency_penalty=0.5,
              presence_penalty=0.5, temperature=0.7, top_k=2, top_p=0.9, min_p=0.1)
    lp.process(x, drafted=[1])
    lp.probs(x, drafted=[1])
    assert torch.equal(x, orig)


# --------------------------------------------------------------- transforms
def test_logit_bias():
    lp = proc(logit_bias={1: 2.0, "3": -1.5}, vocab=4)
    out = lp.process(torch.zeros(2, 4))
    assert torch.equal(out, T([0.0, 2.0, 0.0, -1.5], [0.0, 2.0, 0.0, -1.5]))


def test_repetition_penalty_prompt_and_output():
    # prompt token 0 and output token 1 are penalised; 2, 3 are not.
    lp = proc(prompt=[0], outputs=[1], repetition_penalty=2.0, vocab=4)
    out = lp.process(T([2.0, -2.0, 3.0, -3.0]))
    assert torch.equal(out, T([1.0, -4.0, 3.0, -3.0]))
    # penalised positive logits are divided, negative multiplied
    lp = proc(prompt=[0, 1], repetition_penalty=0.5, vocab=4)
    assert torch.equal(lp.process(T([2.0, -2.0, 3.0, -3.0])), T([4.0, -1.0, 3.0, -3.0]))


def test_frequency_presence_output_only():
    lp = proc(prompt=[3], outputs=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25, vocab=4)
    out = lp.process(torch.zeros(1, 4))
    assert torch.allclose(out, T([0.0, -1.25, -0.75, 0.0]))
    lp = proc(outputs=[1, 1, 2], frequency_penalty=-1.0, vocab=4)
    assert torch.allclose(lp.process(torch.zeros(1, 4)), T([0.0, 2.0, 1.0, 0.0]))


def test_order_bias_then_penalty_then_temperature():
    # bias first: (1 + 1) / 2 = 1.0 (penalty-then-bias would give 1.5); then temperature 0.5 -> 2.0
    lp = proc(prompt=[0], logit_bias={0: 1.0}, repetition_penalty=2.0, temperature=0.5, vocab=2)
    assert torch.allclose(lp.process(T([1.0, 1.0])), T([2.0, 2.0]))
    # greedy: no temperature division
    lp = proc(prompt=[0], logit_bias={0: 1.0}, repetition_penalty=2.0, temperature=0.0, vocab=2)
    assert torch.allclose(lp.process(T([1.0, 1.0])), T([1.0, 1.0]))


def test_row_i_sees_drafted_prefix():
    lp = proc(outputs=[0], repetition_penalty=2.0, frequency_penalty=0.5, vocab=5)
    x = torch.full((4, 5), 4.0)
    out = lp.process(x, drafted=[2, 3, 2])
    # committed token 0: 4/2 - 0.5 = 1.5 in every row
    assert torch.allclose(out[:, 0], torch.full((4,), 1.5))
    # row 0 sees no draft, row 1 sees [2], row 2 sees [2, 3], row 3 sees [2, 3, 2]
    assert torch.allclose(out[:, 2], T(4.0, 1.5, 1.5, 1.0))
    assert torch.allclose(out[:, 3], T(4.0, 4.0, 1.5, 1.5))
    assert torch.allclose(out[:, 1], torch.full((4,), 4.0))
    # the drafter's view: one row from `start` equals the matching target row
    for j in range(4):
        single = lp.process(x[:1], drafted=[2, 3, 2][:j], offset=j)
        assert torch.equal(single[0], out[j])
        assert torch.equal(lp.process(x[:1], drafted=[2, 3, 2], start=j)[0], out[j])  # alias; extra drafts unused
    # committing the drafts gives the same distribution as the last row
    lp.accept([2, 3, 2])
    assert torch.equal(lp.process(x[:1])[0], out[3])
    with pytest.raises(ValueError):
        lp.process(x, drafted=[1])


def test_presence_with_drafts_and_temperature():
    lp = proc(presence_penalty=1.0, temperature=2.0, vocab=3)
    out = lp.process(torch.zeros(3, 3), drafted=[1, 1])
    assert torch.allclose(out, T([0.0, 0.0, 0.0], [0.0, -0.5, 0.0], [0.0, -0.5, 0.0]))


def test_top_k():
    x = T([1.0, 5.0, 3.0, 4.0, 2.0])
    assert kept(proc(top_k=2).process(x)) == {1, 3}
    assert kept(proc(top_k=1).process(x)) == {1}
    assert kept(proc(top_k=5).process(x)) == {0, 1, 2, 3, 4}
    assert kept(proc(top_k=50).process(x)) == {0, 1, 2, 3, 4}
    assert kept(proc(top_k=-1).process(x)) == {0, 1, 2, 3, 4}
    # ties with the k-th value are kept
    assert kept(proc(top_k=2).process(T([1.0, 3.0, 3.0, 3.0]))) == {1, 2, 3}
    out = proc(top_k=2, temperature=2.0).process(x)
    assert out[0, 1] == 2.5 and out[0, 3] == 2.0  # kept values are the tempered logits


PROBS = [0.5, 0.25, 0.15, 0.1]


@pytest.mark.parametrize("top_p,expected", [(0.45, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3}),
                                            (1.0, {0, 1, 2, 3}), (1e-6, {0})])
def test_top_p(top_p, expected):
    x = torch.tensor(PROBS).log()[[2, 0, 3, 1]]  # shuffled: token ids 1, 3, 0, 2 carry .5 .25 .15 .1
    perm = [2, 0, 3, 1]
    got = proc(top_p=top_p).process(x)
    assert kept(got) == {perm.index(i) for i in expected}
    # kept entries renormalise over the kept set
    probs = torch.softmax(got, -1)
    ref = torch.tensor(PROBS)[[2, 0, 3, 1]]
    mask = torch.isfinite(got)
    assert torch.allclose(probs[mask], ref[mask] / ref[mask].sum())


def test_top_k_then_top_p_on_renormalised():
    x = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # after top-k=3: [4/9, 3/9, 2/9]; mass before the 3rd is 7/9 >= 0.75 -> keep 2.
    assert kept(proc(top_k=3, top_p=0.75).process(x)) == {0, 1}
    # top-p alone on the original: mass before the 3rd is 0.7 < 0.75 -> keep 3.
    assert kept(proc(top_p=0.75).process(x)) == {0, 1, 2}


@pytest.mark.parametrize("min_p,expected", [(0.4, {0, 1}), (0.25, {0, 1, 2}), (0.1, {0, 1, 2, 3}), (1.0, {0}),
                                            (0.55, {0})])
def test_min_p(min_p, expected):
    x = torch.tensor(PROBS).log() + 3.0  # shift must not matter
    assert kept(proc(min_p=min_p).process(x)) == expected
    # min-p is applied after temperature: T=2 flattens the ratios to sqrt: .707, .548, .447 >= 0.4
    if min_p == 0.4:
        assert kept(proc(min_p=min_p, temperature=2.0).process(x)) == {0, 1, 2, 3}
        assert kept(proc(min_p=min_p, temperature=0.5).process(x)) == {0}  # ratios squared: .25 < .4


def test_greedy_path_skips_truncation_and_temperature():
    lp = proc(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, outputs=[1], repetition_penalty=2.0, vocab=3)
    out = lp.process(T([1.0, 4.0, 3.0]))
    assert torch.equal(out, T([1.0, 2.0, 3.0]))
    assert greedy(out) == [2]
    assert torch.equal(lp.probs(T([1.0, 4.0, 3.0])), T([0.0, 0.0, 1.0]))
    # greedy fast path returns the logits as they are
    x = T([1.0, 4.0, 3.0])
    assert torch.equal(proc(temperature=0.0).process(x), x)


def test_probs_is_softmax_of_process():
    lp = proc(temperature=0.7, top_k=3, outputs=[2], presence_penalty=0.5, vocab=6)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    pr = lp.probs(x, drafted=[4])
    assert torch.allclose(pr, torch.softmax(lp.process(x, drafted=[4]), -1))
    assert torch.allclose(pr.sum(-1), torch.ones(2))
    assert ((pr > 0).sum(-1) == 3).all()


def test_tiny_temperature_is_finite():
    x = T([10.0, 9.0, -5.0])
    pr = proc(temperature=1e-6).probs(x)  # the smallest temperature SamplingParams allows
    assert torch.isfinite(pr).all() and torch.allclose(pr, T([1.0, 0.0, 0.0]))
    pr = proc(temperature=1e-6, top_p=0.5, repetition_penalty=1e-3, outputs=[0]).probs(x * 1e3)
    assert torch.isfinite(pr).all() and torch.allclose(pr, T([1.0, 0.0, 0.0]))


def test_padded_and_narrow_logits():
    lp = proc(prompt=[1], outputs=[5], repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={3: 1.0},
              vocab=4)
    out = lp.process(torch.full((2, 6), 2.0), drafted=[4])  # wider than vocab: ids 4 and 5 are padding rows
    ninf = float("-inf")
    assert torch.equal(out, T([2.0, 1.0, 2.0, 3.0, ninf, ninf], [2.0, 1.0, 2.0, 3.0, ninf, ninf]))
    lp2 = proc(outputs=[5], top_k=2, vocab=4)
    assert kept(lp2.process(T([1.0, 2.0, 3.0, 0.0, 0.0, 50.0]))) == {1, 2}  # a padding row is never kept
    greedy = proc(vocab=4, logit_bias={3: 1.0}, temperature=0.0)
    assert int(greedy.process(T([1.0, 2.0, 3.0, 0.0, 0.0, 50.0])).argmax()) == 2  # nor the argmax
    assert torch.equal(greedy.probs(T([0.0, 0.0, 0.0, 0.0, 9.0])), T([0.0, 0.0, 0.0, 1.0, 0.0]))
    narrow = lp.process(torch.full((2, 3), 2.0), drafted=[4])  # narrower: ids >= 3 ignored
    assert narrow.shape == (2, 3) and torch.allclose(narrow[:, 1], torch.full((2,), 1.0))


def test_state_dict_round_trip():
    lp = proc(prompt=[0], outputs=[1, 2, 2], frequency_penalty=0.3, repetition_penalty=1.2, vocab=5)
    x = torch.randn(1, 5, generator=torch.Generator().manual_seed(1))
    expected = lp.process(x)
    state = lp.state_dict()
    assert state == {"output_ids": [1, 2, 2]}
    fresh = proc(prompt=[0], frequency_penalty=0.3, repetition_penalty=1.2, vocab=5)
    fresh.process(x)  # builds its (empty) cache first
    fresh.load_state_dict(state)
    assert torch.equal(fresh.process(x), expected) and fresh.output_ids == [1, 2, 2]
    forked = lp.fork()
    forked.accept([3])
    assert lp.output_ids == [1, 2, 2] and torch.equal(lp.process(x), expected)
    assert not torch.equal(forked.process(x), expected)


# ------------------------------------------------------------------ sampler
def test_sample_exact_and_seeded():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4)
    draws = sample(probs, make_generator(7))
    assert draws.shape == (20000,)
    assert torch.equal(draws, sample(probs, make_generator(7)))
    counts = torch.bincount(draws, minlength=4).double()
    assert counts[1] == 0
    ref = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64) * 20000
    assert stats.chisquare(counts[[0, 2, 3]].numpy(), ref.numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 1.0]), make_generator(1)).item() == 1


def test_sample_zero_mass_edges_and_errors():
    g = make_generator(3)
    probs = torch.tensor([[0.0, 0.0, 2.0, 0.0, 6.0, 0.0, 0.0]]).expand(20000, 7)  # unnormalised, zeros at both ends
    counts = torch.bincount(sample(probs, g), minlength=7)
    assert counts[[0, 1, 3, 5, 6]].sum() == 0
    assert stats.chisquare(counts[[2, 4]].double().numpy(), [5000.0, 15000.0]).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 1e-30]), g).item() == 2
    assert sample(torch.tensor([1.0, 0.0, 0.0]), g).item() == 0
    for bad in ([0.0, 0.0], [0.5, -0.1, 0.6], [float("nan"), 1.0], [float("inf"), 1.0]):
        with pytest.raises((ValueError, RuntimeError)):
            sample(torch.tensor(bad), g)


def test_make_generator():
    a = torch.rand(4, generator=make_generator(None))
    b = torch.rand(4, generator=make_generator(None))
    assert not torch.equal(a, b)
    assert torch.equal(torch.rand(4, generator=make_generator(-1)), torch.rand(4, generator=make_generator(-1)))
    make_generator(2**70)
    assert not torch.equal(torch.rand(4, generator=make_generator(1)), torch.rand(4, generator=make_generator(2)))


def test_top_logprobs():
    logits = T([0.0, math.log(3.0), math.log(6.0), NEG_INF], [1.0, 1.0, 1.0, 1.0])
    out = top_logprobs(logits, torch.tensor([0, 3]), 2)
    lp = [math.log(0.1), math.log(0.3), math.log(0.6)]
    assert out[0]["token_id"] == 0 and math.isclose(out[0]["logprob"], lp[0], rel_tol=1e-5)
    assert out[0]["rank"] == 3
    assert [t for t, _ in out[0]["top"]] == [2, 1]
    assert all(math.isclose(v, e, rel_tol=1e-5) for (_, v), e in zip(out[0]["top"], [lp[2], lp[1]]))
    assert math.isclose(out[1]["logprob"], math.log(0.25), rel_tol=1e-5) and out[1]["rank"] == 1
    assert top_logprobs(logits, torch.tensor([1, 1]), 0)[0]["top"] == []
    assert len(top_logprobs(logits, torch.tensor([1, 1]), 20)[0]["top"]) == 4


# -------------------------------------------------- randomised cross-check
def reference_process(params, prompt, outputs, drafted, offset, logits, vocab):
    """Naive per-row, per-token float64 implementation of the documented transform."""
    n, width = logits.shape
    rows = []
    for i in range(n):
        hist = list(outputs) + list(drafted[: offset + i])
        x = logits[i].double().clone()
        x[vocab:] = float("-inf")  # padding rows are never sampled
        for t, b in (params.logit_bias or {}).items():
            if t < width:
                x[t] += b
        counts = {}
        for t in hist:
            if t < width:
                counts[t] = counts.get(t, 0) + 1
        if params.repetition_penalty != 1.0:
            for t in set(prompt) | set(counts):
                if t < width:
                    x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        for t, c in counts.items():
            x[t] -= params.frequency_penalty * c + params.presence_penalty
        if params.temperature == 0:
            rows.append(x)
            continue
        x = x / params.temperature
        if 0 < params.top_k < width:
            kth = sorted(x.tolist(), reverse=True)[params.top_k - 1]
            x[x < kth] = float("-inf")
        if params.top_p < 1:
            probs = torch.softmax(x, -1)
            order = sorted(range(width), key=lambda j: -probs[j].item())
            cum, keep = 0.0, set()
            for j in order:
                if cum >= params.top_p:
                    break
                keep.add(j)
                cum += probs[j].item()
            for j in range(width):
                if j not in keep:
                    x[j] = float("-inf")
        if params.min_p > 0:
            probs = torch.softmax(x, -1)
            x[probs < params.min_p * probs.max()] = float("-inf")
        rows.append(x)
    return torch.stack(rows)


def test_matches_naive_reference_on_random_cases():
    g = torch.Generator().manual_seed(1234)
    rnd = lambda: torch.rand(1, generator=g).item()  # noqa: E731
    for case in range(60):
        vocab = 5 + int(rnd() * 10)
        width = vocab + int(rnd() * 3)  # sometimes padded
        kw = dict(
            temperature=0.0 if rnd() < 0.2 else 0.3 + 1.5 * rnd(),
            repetition_penalty=1.0 if rnd() < 0.3 else 0.5 + 1.5 * rnd(),
            frequency_penalty=0.0 if rnd() < 0.3 else 4 * rnd() - 2,
            presence_penalty=0.0 if rnd() < 0.3 else 4 * rnd() - 2,
            top_k=0 if rnd() < 0.4 else 1 + int(rnd() * vocab),
            top_p=1.0 if rnd() < 0.4 else 0.05 + 0.9 * rnd(),
            min_p=0.0 if rnd() < 0.4 else 0.3 * rnd(),
            logit_bias=None if rnd() < 0.5 else {int(rnd() * vocab): 10 * rnd() - 5 for _ in range(3)},
        )
        params = SamplingParams(**kw)
        rand_ids = lambda k: [int(rnd() * width) for _ in range(k)]  # noqa: E731
        prompt, outputs = rand_ids(int(rnd() * 6)), rand_ids(int(rnd() * 6))
        n = 1 + int(rnd() * 4)
        offset = int(rnd() * 3)
        drafted = rand_ids(offset + n - 1 + int(rnd() * 2))
        logits = torch.randn(n, width, generator=g) * 3
        lp = LogitsProcessor(params, prompt, vocab)
        lp.accept(outputs[:2])
        lp.process(logits, drafted, offset)  # build the caches before more tokens are committed
        lp.accept(outputs[2:])
        got = lp.process(logits, drafted, offset)
        ref = reference_process(params, prompt, outputs, drafted, offset, logits, vocab).float()
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), (case, kw, got, ref)
        fin = torch.isfinite(ref)
        assert torch.allclose(got[fin], ref[fin], atol=1e-4, rtol=1e-4), (case, kw)


# ------------------------------------------------------------------ min_tokens
def test_min_tokens_holds_the_ends_back_row_by_row():
    """Row i of a verify pass is output position len(output) + i: the EOS ids and stop_token_ids are -inf until
    min_tokens tokens exist, then free again; with ignore_eos only the stop ids are held."""
    x = T(*[[0.0, 5.0, 1.0, 2.0, 3.0, 4.0, 0.5, 9.0]] * 4)  # id 7 the most likely
    lp = LogitsProcessor(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]), [1], 8, eos_ids=[7])
    lp.accept([2])
    out = lp.process(x, drafted=[4, 4, 4])  # rows at output positions 1, 2, 3, 4
    assert torch.isneginf(out[:2, [5, 7]]).all() and torch.isfinite(out[2:]).all()
    assert list(greedy(out)) == [1, 1, 7, 7]
    assert not lp.greedy_on_raw_logits
    assert torch.equal(lp.process(x[1:], drafted=[4, 4, 4], offset=1), out[1:])  # a drafter's row by row
    lp.accept([3, 3])
    assert torch.equal(lp.process(x), x) and lp.greedy_on_raw_logits  # min_tokens reached: nothing held
    kept_eos = LogitsProcessor(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[5]), [], 8, eos_ids=[7])
    assert kept(kept_eos.process(x[0])) == set(range(8)) - {5}
    assert torch.equal(x, T(*[[0.0, 5.0, 1.0, 2.0, 3.0, 4.0, 0.5, 9.0]] * 4))  # the input untouched


def test_min_tokens_never_empties_a_row():
    """Where nothing but an end is allowed (all else -inf: a finished grammar) the row keeps it: an empty
    distribution could not be sampled."""
    x = T([NEG_INF, NEG_INF, 1.0, NEG_INF], [0.5, NEG_INF, 1.0, NEG_INF])
    lp = LogitsProcessor(SamplingParams(min_tokens=4), [], 4, eos_ids=[2])
    out = lp.process(x, drafted=[0])
    assert torch.equal(out[0], x[0]) and kept(out[1]) == {0}
    assert torch.isfinite(lp.probs(x, drafted=[0])).all()
