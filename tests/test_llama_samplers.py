"""llama.cpp's samplers (typical_p, top_n_sigma, XTC, DRY) and vLLM's allowed_token_ids and bad_words: llama.cpp's own
test cases
(tests/test-sampling.cpp) give the same numbers here, each sampler equals a naive float64 reading of its definition
on random rows, rows after drafted tokens equal rows after committed ones (what keeps speculation exact), bad values
are refused by name, and DRY with a real tokenizer keeps greedy speculative output equal to plain."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from quickdraft import LLM
from quickdraft.errors import InvalidParameterError
from quickdraft.sampling import LogitsProcessor, SamplingParams, sequence_breakers
from quickdraft.sampling.dry import SequenceBreakers, dry_penalties

NEG_INF = float("-inf")


def breakers_of(vocab: int, sequences: list[list[int]]) -> SequenceBreakers:
    """Breakers given as token sequences (llama.cpp's llama_sampler_init_dry_testing): head token, then its tail."""
    whole = np.zeros(vocab, dtype=bool)
    tails: dict[int, list[tuple[int, ...]]] = {}
    for seq in sequences:
        if len(seq) == 1:
            whole[seq[0]] = True
        else:
            tails.setdefault(seq[0], []).append(tuple(seq[1:]))
    heads = whole.copy()
    heads[list(tails)] = True
    return SequenceBreakers(whole, heads, {t: tuple(v) for t, v in tails.items()})


def probs_after(probs: list[float], context: list[int], breakers: list[list[int]] = (), **kw) -> list[float]:
    vocab = len(probs)
    proc = LogitsProcessor(SamplingParams(**kw), context, vocab, breakers=breakers_of(vocab, list(breakers)))
    return proc.probs(torch.tensor([math.log(p) for p in probs])).tolist()


@pytest.mark.parametrize("probs,context,expected,multiplier,base,allowed,last_n,breakers", [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
])
def test_dry_gives_llama_cpps_numbers(probs, context, expected, multiplier, base, allowed, last_n, breakers):
    got = probs_after(probs, context, breakers, temperature=1.0, dry_multiplier=multiplier, dry_base=base,
                      dry_allowed_length=allowed, dry_penalty_last_n=last_n)
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("last", [3, 64, -1, 0])
def test_repeat_last_n_penalizes_as_llama_cpp(last):
    """llama.cpp's penalties: repetition, frequency and presence all count the last repeat_last_n tokens of prompt
    and output together; a verify pass's row i counts its drafts too, as a committed output would."""
    prompt, output, drafts = [1, 2, 3, 2, 9], [4, 2, 4, 7], [5, 5, 1]
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6, repeat_last_n=last)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
    proc = LogitsProcessor(SamplingParams(temperature=0.0, **penalties), prompt, 12)
    proc.accept(output)
    got = proc.process(x, drafted=drafts)
    for i in range(4):
        seen = (prompt + output + drafts[:i])
        window = [] if last == 0 else seen if last < 0 else seen[-last:]
        expected = x[i].clone()
        for token in set(window):
            logit = expected[token]
            logit = logit / 1.3 if logit > 0 else logit * 1.3
            expected[token] = logit - 0.4 * window.count(token) - 0.6
        assert torch.allclose(got[i], expected, atol=1e-6), (last, i)
        alone = LogitsProcessor(SamplingParams(temperature=0.0, **penalties), prompt, 12)
        alone.accept(output + drafts[:i])
        assert torch.equal(alone.process(x[i:i + 1])[0], got[i])
    proc.accept(drafts[:2])  # the counts kept as tokens are committed
    assert torch.equal(proc.process(x[2:3])[0], got[2])


@pytest.mark.parametrize("cuts", [{"top_p": 0.8}, {"min_p": 0.1}, {"typical_p": 0.7}, {"top_k": 5, "top_p": 0.9},
                                  {"top_n_sigma": 1.0}, {"min_p": 0.02, "xtc_probability": 0.4, "xtc_threshold": 0.1}])
def test_temperature_last_cuts_the_untempered_distribution_then_tempers_it(cuts):
    """llama-server's default chain: the cuts (and XTC's choice of tokens) read the untempered row; the kept tokens'
    logits are then divided by the temperature (XTC's two branches each tempered)."""
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float() * 2
    temperature = 0.6
    got = LogitsProcessor(SamplingParams(temperature=temperature, temperature_last=True, **cuts), [1], 50).probs(x)
    plain_cuts = {k: v for k, v in cuts.items() if not k.startswith("xtc")}
    kept = LogitsProcessor(SamplingParams(temperature=1.0, **plain_cuts), [1], 50).probs(x) > 0
    tempered = (x / temperature).masked_fill(~kept, NEG_INF)
    expected = torch.softmax(tempered, -1)
    if "xtc_probability" in cuts:
        untempered = torch.softmax(x.masked_fill(~kept, NEG_INF), -1)
        for row in range(4):
            above = [t for t in range(50) if untempered[row, t] >= cuts["xtc_threshold"]]
            if len(above) >= 2:
                least = min(untempered[row, t] for t in above)
                removed = torch.zeros(50, dtype=torch.bool)
                removed[[t for t in above if untempered[row, t] > least]] = True
                excluded = torch.softmax(tempered[row].masked_fill(removed, NEG_INF), -1)
                expected[row] = (1 - cuts["xtc_probability"]) * expected[row] + cuts["xtc_probability"] * excluded
    assert torch.allclose(got, expected, atol=1e-6)
    first = LogitsProcessor(SamplingParams(temperature=temperature, **cuts), [1], 50).probs(x)
    # (top_n_sigma's cut scales with the logits: it is the same before or after the temperature)
    assert torch.allclose(got, first, atol=1e-6) == ("top_n_sigma" in cuts)


def test_top_n_sigma_and_typical_give_llama_cpps_numbers():
    assert probs_after([0.1, 0.2, 0.3, 0.4], [], top_n_sigma=1.0) == pytest.approx([0, 0, 0.428571, 0.571429], abs=1e-6)
    assert probs_after([0.1, 0.2, 0.3, 0.4], [], top_n_sigma=0.0) == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-6)
    assert probs_after([0.97, 0.01, 0.01, 0.01], [], typical_p=0.5) == pytest.approx([1, 0, 0, 0], abs=1e-6)
    assert probs_after([0.4, 0.2, 0.2, 0.2], [], typical_p=0.5) == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3], abs=1e-6)


def naive_dry(context: list[int], vocab: int, p: SamplingParams, breakers: list[list[int]]) -> dict[int, float]:
    """DRY from its definition: the longest suffix of the window (not reaching back across a breaker) that also
    ends at an earlier position j; the token after j is penalized for the longest such suffix."""
    window = context[-p.dry_penalty_last_n:] if p.dry_penalty_last_n > 0 else list(context)
    n = len(window)
    if n <= p.dry_allowed_length:
        return {}
    limit = n
    for back in range(n):  # the breaker nearest the end, its tail ending within the window
        pos = n - 1 - back
        longest = max((len(b) - 1 for b in breakers if window[pos] == b[0] and len(b) - 1 <= back
                       and window[pos + 1:pos + len(b)] == b[1:]), default=-1)
        if longest >= 0:
            limit = back - longest
            break
    best: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length < limit and j - length >= 0 and window[j - length] == window[n - 1 - length]:
            length += 1
        if length >= p.dry_allowed_length and not any(b == [window[j + 1]] for b in breakers):
            best[window[j + 1]] = max(best.get(window[j + 1], 0), length)
    top = math.floor(88.7228391 / math.log(p.dry_base)) if p.dry_base > 1.000001 else math.inf
    return {t: min(p.dry_multiplier * p.dry_base ** min(length - p.dry_allowed_length, top), 1e30)
            for t, length in best.items()}


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "numpy"])
def test_dry_equals_its_definition_on_random_contexts(kernel, monkeypatch):
    """The native Z-algorithm (linear: a context of one repeated token is n steps) and the numpy fallback (matches
    extended a token at a time) both give the definition's penalties."""
    from quickdraft.models import native
    if kernel and not native.available():
        pytest.skip("no native kernels on this machine")
    if not kernel:
        monkeypatch.setattr(native, "dry_repeats", lambda tokens, limit: None)
    rng = random.Random(7)
    for case in range(300):
        vocab = rng.randint(2, 6)
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))] * rng.choice([1, 1, 4])
        breakers = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 2))]
        p = SamplingParams(dry_multiplier=rng.choice([0.5, 1.0, 3.0]), dry_base=rng.choice([1.0, 1.5, 1.75, 1e30]),
                           dry_allowed_length=rng.randint(1, 4), dry_penalty_last_n=rng.choice([-1, 5, 12]))
        ids, penalties = dry_penalties(np.array(context, dtype=np.int64), p, breakers_of(vocab, breakers))
        got = dict(zip(ids.tolist(), penalties.tolist()))
        assert got == pytest.approx(naive_dry(context, vocab, p, breakers), rel=1e-12), (case, context, breakers)


def test_a_long_repeat_costs_at_most_the_cap_and_leaves_the_row_finite():
    p = SamplingParams(temperature=1.0, dry_multiplier=1e38, dry_base=100.0, dry_allowed_length=1)
    proc = LogitsProcessor(p, [1, 2] * 200, 4)
    row = proc.process(torch.zeros(4))
    assert torch.isfinite(row).all() and row[1] == -1e30 and row[0] == 0


@pytest.mark.parametrize("params,bad", [
    (dict(dry_multiplier=0.8, dry_allowed_length=1, temperature=0), ()),
    (dict(dry_multiplier=1.5, dry_base=2.0, dry_penalty_last_n=6, temperature=0.8), ()),
    (dict(typical_p=0.7, top_n_sigma=1.2, xtc_probability=0.5, xtc_threshold=0.15, temperature=1.3), ()),
    (dict(allowed_token_ids=[0, 2, 3, 5], dry_multiplier=1.0, top_k=4, temperature=0.9), ()),
    (dict(temperature=0), ((3,), (1, 2), (4, 4, 0))),  # bad words as their token sequences
])
def test_rows_after_drafted_tokens_equal_rows_after_committed_ones(params, bad):
    """Row i of a verification (after drafted[:offset + i]) is what plain decoding sees there once those tokens
    are committed: the condition for speculative output to keep the target's distribution."""
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    for _ in range(40):
        vocab = 7
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        committed = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        drafted = [rng.randrange(vocab) for _ in range(4)]
        offset = rng.randint(0, 1)
        logits = torch.randn(3, vocab, generator=g) * 2
        brk = breakers_of(vocab, [[4], [6, 1]])
        verifying = LogitsProcessor(SamplingParams(**params), prompt, vocab, breakers=brk, bad_words=bad)
        verifying.accept(committed)
        rows = verifying.process(logits, drafted, offset)
        for i in range(3):
            plain = LogitsProcessor(SamplingParams(**params), prompt, vocab, breakers=brk, bad_words=bad)
            plain.accept(committed + drafted[:offset + i])
            assert torch.equal(plain.process(logits[i]), rows[i])


def naive_typical(logits: torch.Tensor, mass: float) -> set[int]:
    p = torch.softmax(logits.double(), -1)
    entropy = -sum(float(q * math.log(q)) for q in p if q > 0)
    order = sorted((j for j in range(len(p)) if p[j] > 0), key=lambda j: abs(-math.log(p[j]) - entropy))
    keep, cum = [], 0.0
    for j in order:
        if cum >= mass:
            break
        keep.append(j)
        cum += float(p[j])
    return set(keep)


def test_typical_and_top_n_sigma_equal_their_definitions_on_random_rows():
    g = torch.Generator().manual_seed(11)
    for _ in range(200):
        row = torch.randn(9, generator=g) * 3
        mass = float(torch.rand(1, generator=g)) * 0.98 + 0.01
        got = LogitsProcessor(SamplingParams(typical_p=mass), [], 9).process(row)
        assert {j for j in range(9) if math.isfinite(got[j])} == naive_typical(row, mass)
        n = float(torch.rand(1, generator=g)) * 3
        got = LogitsProcessor(SamplingParams(top_n_sigma=n), [], 9).process(row)
        x = row.double()
        bound = float(x.max()) - n * float(x.std(unbiased=False))
        near = {j for j in range(9) if abs(float(x[j]) - bound) <= 1e-5}  # float32 may fall either way there
        assert {j for j in range(9) if math.isfinite(got[j])} - near == {j for j in range(9) if x[j] > bound} - near


def test_xtc_is_the_mixture_of_both_outcomes():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    got = LogitsProcessor(SamplingParams(xtc_probability=0.25, xtc_threshold=0.15), [], 5).probs(probs.log())
    excluded = torch.tensor([0, 0, 0.2, 0.06, 0.04]) / 0.3  # 0.4 and 0.3 removed, 0.2 (the least above) stays
    assert got.tolist() == pytest.approx((0.75 * probs + 0.25 * excluded).tolist(), abs=1e-6)
    # one token above the threshold, or a threshold above 0.5: nothing is removed
    for kw in ({"xtc_threshold": 0.35}, {"xtc_threshold": 0.6}):
        got = LogitsProcessor(SamplingParams(xtc_probability=1.0, **kw), [], 5).probs(probs.log())
        assert got.tolist() == pytest.approx(probs.tolist(), abs=1e-6)
    # tied at the least probability above the threshold: both stay
    tied = torch.tensor([0.5, 0.2, 0.2, 0.1])
    got = LogitsProcessor(SamplingParams(xtc_probability=1.0, xtc_threshold=0.15), [], 4).probs(tied.log())
    assert got.tolist() == pytest.approx([0, 0.4, 0.4, 0.2], abs=1e-6)


def test_allowed_token_ids_mask_every_other_id_greedy_too():
    proc = LogitsProcessor(SamplingParams(temperature=0, allowed_token_ids=[1, 3]), [], 5)
    assert not proc.greedy_on_raw_logits
    row = proc.process(torch.tensor([9.0, 1.0, 8.0, 2.0, 7.0]))
    assert row.tolist() == [NEG_INF, 1.0, NEG_INF, 2.0, NEG_INF]
    with pytest.raises(InvalidParameterError, match=r"allowed_token_ids entry must be a token id in \[0, 5\), got 7"):
        SamplingParams(allowed_token_ids=[1, 7]).check_vocab(5)


@pytest.mark.parametrize("field,value,message", [
    ("typical_p", 0.0, r"typical_p must be in \(0, 1\]"),
    ("typical_p", float("nan"), "typical_p must be a number"),
    ("top_n_sigma", float("inf"), "top_n_sigma must be a number"),
    ("top_n_sigma", "2", "top_n_sigma must be a number"),
    ("xtc_probability", 1.5, r"xtc_probability must be in \[0, 1\]"),
    ("xtc_threshold", -1e-300, r"xtc_threshold must be in \[0, 1\]"),
    ("dry_multiplier", -0.1, "dry_multiplier must be >= 0"),
    ("dry_multiplier", True, "dry_multiplier must be a number"),
    ("dry_base", 0.5, "dry_base must be >= 1"),
    ("dry_allowed_length", 0, "dry_allowed_length must be >= 1"),
    ("dry_allowed_length", 2.0, "dry_allowed_length must be an int"),
    ("dry_penalty_last_n", -2, "dry_penalty_last_n must be >= -1"),
    ("dry_sequence_breakers", "\n", "dry_sequence_breakers must be a list"),
    ("dry_sequence_breakers", [""], "dry_sequence_breakers must be a list"),
    ("dry_sequence_breakers", ["x"] * 17, "at most 16"),
    ("dry_sequence_breakers", ["y" * 41], "at most 40 characters"),
    ("dry_sequence_breakers", ["\ud800"], "dry_sequence_breakers"),
    ("allowed_token_ids", [], "allowed_token_ids must be a list of at least one"),
    ("allowed_token_ids", [-1], "allowed_token_ids entry must be a token id >= 0"),
    ("allowed_token_ids", list(range((1 << 18) + 1)), "at most 262144"),
    ("bad_words", "word", "bad_words must be a list"),
    ("bad_words", [" "], "bad_words must be a list of at most 64 non-empty strings"),
    ("bad_words", ["w"] * 65, "at most 64"),
    ("typical_p", 10 ** 400, "typical_p must be a number"),  # past float's range: no OverflowError escapes
    ("dry_base", "x" * 10 ** 6, "dry_base must be a number"),
])
def test_bad_values_are_refused_by_name(field, value, message):
    with pytest.raises(InvalidParameterError, match=message) as refused:
        SamplingParams(**{field: value})
    assert len(str(refused.value)) < 400  # a client's megabytes are not echoed back


def test_allowed_token_ids_beside_a_grammar_are_refused():
    with pytest.raises(InvalidParameterError, match="allowed_token_ids cannot be combined with structured outputs"):
        SamplingParams(allowed_token_ids=[1], structured_outputs={"choice": ["yes", "no"]})


def test_breakers_in_a_real_vocabulary(smollm2):
    llm = LLM(str(smollm2), speculative="ngram", num_speculative_tokens=4)
    tok = llm.tokenizer
    found = sequence_breakers(tok, ["\n", ":", '"', "*", "User:"])
    texts = tok.token_bytes()
    assert found.whole[tok.encode("\n", add_special_tokens=False)[0]]
    assert all((b"\n" in (texts[t] or b"")) or (b":" in (texts[t] or b"")) or (b'"' in (texts[t] or b""))
               or (b"*" in (texts[t] or b"")) or (b"User:" in (texts[t] or b"")) for t in np.flatnonzero(found.whole))
    # a token ending with "Us" is a head whose tail is the tokens of "er:"
    heads = [t for t, tails in found.tails.items() if (texts[t] or b"").endswith(b"Us")]
    assert heads and all(tuple(tok.encode("er:", add_special_tokens=False)) in found.tails[t] for t in heads)
    assert sequence_breakers(tok, ["\n", ":", '"', "*", "User:"]) is found  # built once
    # per string, as llama.cpp: a token holding "er" still ends with "Us"'s beginning of "User:"
    assert sequence_breakers(tok, ["er", "User:"]).tails == sequence_breakers(tok, ["User:", "er"]).tails


def test_the_breakers_cache_does_not_keep_its_tokenizers(tiny_dir):
    import gc
    import weakref
    from quickdraft.tokenizer import Tokenizer
    model = tiny_dir(arch="llama", vocab_size=64)
    gone = []
    for _ in range(3):
        tokenizer = Tokenizer.from_hf_dir(model)
        sequence_breakers(tokenizer, ["\n"])
        gone.append(weakref.ref(tokenizer))
        del tokenizer
    gc.collect()
    assert all(ref() is None for ref in gone)


def test_dry_under_speculation_keeps_greedy_output_equal(smollm2):
    """n-gram drafts are the repeats DRY penalizes: the rows that verify them must be DRY's rows."""
    from quickdraft import SamplingParams as P
    prompt = "one two three four one two three four one two three four one two three four"
    kw = dict(temperature=0, max_tokens=48, dry_multiplier=0.8, dry_allowed_length=2)
    speculative = LLM(str(smollm2), speculative="ngram", num_speculative_tokens=4)
    plain = speculative.generate([prompt], P(**kw, speculative=False))[0].outputs[0]
    drafted = speculative.generate([prompt], P(**kw))[0].outputs[0]
    undamped = speculative.generate([prompt], P(temperature=0, max_tokens=48, speculative=False))[0].outputs[0]
    assert drafted.token_ids == plain.token_ids
    assert plain.token_ids != undamped.token_ids  # DRY changed what greedy decoding picks


def test_bad_words_are_never_spelled(smollm2):
    """vLLM's bad_words: the greedy answer's word, banned, is gone from it (at the start of the text and after a
    space), with and without n-gram drafts, which propose exactly the repeats a ban cuts."""
    from quickdraft import SamplingParams as P
    from quickdraft.sampling import vocabulary_inputs
    llm = LLM(str(smollm2), speculative="ngram", num_speculative_tokens=4)
    prompt = "The capital of France is Paris. The capital of France is Paris. The capital of France is"
    kw = dict(temperature=0, max_tokens=12)
    free = llm.generate([prompt], P(**kw, speculative=False))[0].outputs[0].text
    assert "Paris" in free
    plain = llm.generate([prompt], P(**kw, bad_words=["Paris"], speculative=False))[0].outputs[0]
    drafted = llm.generate([prompt], P(**kw, bad_words=["Paris"]))[0].outputs[0]
    assert "Paris" not in plain.text and drafted.token_ids == plain.token_ids
    sequences = vocabulary_inputs(llm.tokenizer, P(bad_words=["Paris"]))["bad_words"]
    assert tuple(llm.tokenizer.encode(" Paris", add_special_tokens=False)) in sequences
