"""A draft model of another vocabulary (Token-Level Intersection, speculative/vocab.py).

The draft proposes only tokens both vocabularies spell with the same bytes, with its distribution restricted to
them as q, and reads the target's text re-encoded by its own tokenizer. Output must equal the target's alone
(greedy) and follow its distribution (sampled); the view must track the text through every boundary case.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_checkpoint
from test_distribution import SAMPLES, TRANSFORMS, chi_square_pvalue, exact_distribution, sample_engine

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError, ModelLoadError
from quickdraft.kv import SequenceKV
from quickdraft.speculative.vocab import CrossVocabulary, complete_utf8, shared_tokens

# Two byte-level BPE vocabularies over the letters a, b, c. Both spell a, b, c and abc; the target also has ab,
# ca and bb, which the draft splits in two; the draft has bc, cc and ba, which the target splits.
TARGET_TOKENS = ["<eos>", "a", "b", "c", "ab", "ca", "bb", "abc"]
TARGET_MERGES = [("a", "b"), ("c", "a"), ("b", "b"), ("ab", "c")]
DRAFT_TOKENS = ["<eos>", "a", "b", "c", "bc", "abc", "cc", "ba"]
DRAFT_MERGES = [("b", "c"), ("a", "bc"), ("c", "c"), ("b", "a")]


def write_bpe_tokenizer(directory: Path, tokens: list[str], merges: list[tuple[str, str]]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": None}))
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target and a tiny draft (other architecture, other weights) with the two vocabularies above."""
    root = tmp_path_factory.mktemp("cross")
    target_tok = write_bpe_tokenizer(root / "target_tok", TARGET_TOKENS, TARGET_MERGES)
    draft_tok = write_bpe_tokenizer(root / "draft_tok", DRAFT_TOKENS, DRAFT_MERGES)
    target = make_tiny_checkpoint(root / "target", arch="llama", vocab_size=8, layers=3, hidden=32, heads=4,
                                  kv_heads=2, seed=11, tokenizer_from=target_tok)
    draft = make_tiny_checkpoint(root / "draft", arch="qwen2", vocab_size=8, layers=1, hidden=32, heads=4,
                                 kv_heads=2, seed=12, tokenizer_from=draft_tok)
    return target, draft


def tiny_llm(pair, **options) -> LLM:
    target, draft = pair
    return LLM(str(target), draft=str(draft), draft_weights="float32", dtype="float32", max_num_seqs=1024,
               max_num_batched_tokens=16384, kv_cache_memory="32MiB", **options)


def test_the_pair_shares_the_tokens_both_spell_the_same(pair):
    llm = tiny_llm(pair)
    target_ids, draft_ids = shared_tokens(llm.tokenizer, llm.drafter.vocab.draft_tokenizer)
    assert [TARGET_TOKENS[i] for i in target_ids] == ["a", "b", "c", "abc"]  # <eos> is special: never shared
    assert [DRAFT_TOKENS[i] for i in draft_ids] == ["a", "b", "c", "abc"]
    assert llm.loaded.draft_pairing == "draft drafts for target over 4 shared tokens"


@pytest.mark.parametrize("transform", ["plain", "topk_topp", "penalties"])
def test_sampled_output_follows_the_target_distribution(pair, transform):
    llm = tiny_llm(pair, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, **TRANSFORMS[transform])
    dist = exact_distribution(llm, params)
    samples = sample_engine(llm, params, SAMPLES)
    stats = llm.spec_stats
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    assert chi_square_pvalue(samples, dist) > 0.001


def test_the_draft_head_computes_the_shared_rows_and_q_is_the_restricted_distribution(pair):
    """The draft's head keeps only the rows of shared tokens; q puts all its mass on them, in the draft's
    proportions."""
    llm = tiny_llm(pair)
    assert llm.drafter.runner.model.lm_head.out_features == 4  # the draft ids of a, b, c, abc
    logits = torch.randn(2, 4)
    q = torch.softmax(llm.drafter.vocab.widen(logits), dim=-1)
    assert torch.allclose(q[:, [1, 2, 3, 7]], torch.softmax(logits, dim=-1)) and float(q[:, [0, 4, 5, 6]].sum()) == 0


@pytest.mark.parametrize("run_ahead", [False, True])
def test_greedy_output_equals_the_target_alone(pair, run_ahead):
    target, _ = pair
    prompts = [[3, 5, 2, 3, 5, 2, 3, 5], [4, 7, 1, 6], [1], [7, 7, 7, 4, 4]]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target), dtype="float32", kv_cache_memory="32MiB").generate(prompts, greedy)]
    llm = tiny_llm(pair, num_speculative_tokens=4, run_ahead=run_ahead)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain  # a batch
    assert [llm.generate([p], greedy)[0].token_ids for p in prompts] == plain  # one at a time
    assert llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_view_longer_than_the_draft_positions_stops_drafting_not_the_engine(pair, run_ahead):
    """Every target "ab" is two draft tokens: past the draft model's 512 positions the view cannot be drafted from,
    and with run-ahead the worker must not hit that limit either."""
    target, _ = pair
    prompts, greedy = [[4] * 200], SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), dtype="float32", kv_cache_memory="32MiB").generate(prompts, greedy)[0].token_ids
    llm = tiny_llm(pair, num_speculative_tokens=4, run_ahead=run_ahead)
    assert llm.drafter.runner.model.max_positions < 2 * 450  # the view outgrows the draft model
    assert llm.generate(prompts, greedy)[0].token_ids == plain


def test_seeded_sampling_is_the_same_with_and_without_run_ahead(pair):
    """Run-ahead keeps its drafts only when the re-encoded text is exactly what it drafted from."""
    prompts = [[3, 5, 2, 3, 5, 2, 3, 5], [4, 7, 1, 6]] * 4
    params = [SamplingParams(max_tokens=64, temperature=0.7, seed=s, ignore_eos=True) for s in range(8)]
    without = [o.token_ids for o in tiny_llm(pair, num_speculative_tokens=1).generate(prompts, params)]
    llm = tiny_llm(pair, num_speculative_tokens=1, run_ahead=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == without
    assert llm.spec_stats.run_ahead_rounds > 0


def test_a_pair_sharing_too_little_is_refused_naming_both(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=8, hidden=32, tokenizer_from=write_bpe_tokenizer(
        tmp_path / "tt", TARGET_TOKENS, TARGET_MERGES))
    draft = make_tiny_checkpoint(tmp_path / "d", vocab_size=8, hidden=32, tokenizer_from=write_bpe_tokenizer(
        tmp_path / "dt", ["<eos>", "x", "y", "z", "xy", "yz", "zz", "a"], [("x", "y"), ("y", "z"), ("z", "z")]))
    with pytest.raises(ModelLoadError, match=r"the draft model d and the target t share 1 tokens \(of 8 and 8\); a "
                                             r"draft of another vocabulary needs at least 4 shared tokens"):
        LLM(str(target), draft=str(draft), dtype="float32", kv_cache_memory="16MiB")


def test_draft_vocab_keeps_the_shared_tokens_below_it(pair):
    llm = tiny_llm(pair, draft_vocab=4)  # draft ids below 4: a, b, c (abc is id 5)
    assert llm.drafter.runner.model.lm_head.out_features == 3
    with pytest.raises(InvalidParameterError, match=r"draft_vocab=1 keeps none of the 4 tokens the draft shares with "
                                                    r"the target \(the lowest shared draft id is 1\)"):
        tiny_llm(pair, draft_vocab=1)


def test_complete_utf8_holds_back_a_partial_character():
    text = "a🙂".encode()
    assert [complete_utf8(text[:n]) for n in range(len(text) + 1)] == [0, 1, 1, 1, 1, 5]
    assert complete_utf8(b"\xff\xfe") == 2  # invalid bytes are not waited for


# ---- the draft's view, with the real tokenizers of the Qwen target and the SmolLM2 and Gemma 3 drafts ----------
class FakeSequence:
    def __init__(self) -> None:
        self.token_ids: list[int] = []


@pytest.fixture(scope="module")
def tokenizers():
    from quickdraft.engine.build import tokenizer_for
    from quickdraft.loading import load_checkpoint
    out = {}
    for name in ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"):
        try:
            out[name] = tokenizer_for(load_checkpoint(name))
        except ModelLoadError as exc:
            pytest.skip(f"{name} is not installed (make test installs it): {exc}")
    return out


def bridge(tokenizers, draft: str) -> CrossVocabulary:
    return CrossVocabulary(tokenizers["qwen2.5-coder-0.5b"], tokenizers[draft], "qwen", draft, 151936)


def feed(b: CrossVocabulary, ids: list[int]) -> list[list[int]]:
    """The view after each token, checked against a full re-encoding of the text so far wherever it is complete."""
    seq, views = FakeSequence(), []
    draft = b.draft_tokenizer
    for i in range(len(ids)):
        seq.token_ids = ids[: i + 1]
        view = list(b.view(seq))
        text = b._views[seq].text
        if b.can_draft(seq):
            assert view == b._bos + draft.backend.encode(text.decode(), add_special_tokens=False).ids
        views.append(view)
    return views


@pytest.mark.parametrize("draft", ["smollm2-135m", "gemma3-270m"])
def test_the_view_is_the_draft_tokenizers_encoding_after_every_token(tokenizers, draft):
    qwen = tokenizers["qwen2.5-coder-0.5b"]
    text = qwen.apply_chat_template([{"role": "user", "content": "héllo 日本語 🙂 naïve\t\tdef f(x):\n    return x"}])
    text += "Sure:\n```python\ndef reverse(s: str) -> str:\n    return s[::-1]\n```\n\u00a0\U0001d518 done"
    feed(bridge(tokenizers, draft), qwen.encode(text, add_special_tokens=False))


def test_a_target_token_the_draft_splits_in_two_is_not_shared(tokenizers):
    qwen, smol = tokenizers["qwen2.5-coder-0.5b"], tokenizers["smollm2-135m"]
    (tab_def,) = qwen.encode("\tdef", add_special_tokens=False)  # one Qwen token, two SmolLM2 tokens
    assert smol.encode("\tdef", add_special_tokens=False) == [smol.token_to_id("ĉ"), smol.token_to_id("def")]
    b = bridge(tokenizers, "smollm2-135m")
    assert tab_def not in set(b.target_ids.tolist())
    assert feed(b, [tab_def])[-1] == smol.encode("\tdef", add_special_tokens=False)


def test_special_tokens_are_never_shared_but_reach_the_draft_as_its_own(tokenizers):
    qwen, smol = tokenizers["qwen2.5-coder-0.5b"], tokenizers["smollm2-135m"]
    b = bridge(tokenizers, "smollm2-135m")
    assert not set(b.target_ids.tolist()) & qwen.special_token_ids
    assert not set(b.draft_ids.tolist()) & smol.special_token_ids
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert feed(b, ids)[-1][0] == smol.token_to_id("<|im_start|>")  # SmolLM2's own ChatML token


def test_byte_fallback_and_split_characters(tokenizers):
    """A character Qwen spells in byte tokens: no draft until it is complete; Gemma spells it in byte-fallback
    tokens, which are never chosen over an ordinary token of the same bytes."""
    qwen, gemma = tokenizers["qwen2.5-coder-0.5b"], tokenizers["gemma3-270m"]
    ids = qwen.encode("x\U0001d518", add_special_tokens=False)
    pieces = [qwen.token_bytes()[i] for i in ids]
    assert any(complete_utf8(p) < len(p) for p in pieces)  # the character is split over tokens
    b = bridge(tokenizers, "gemma3-270m")
    seq = FakeSequence()
    drafts = []
    for n in range(1, len(ids) + 1):
        seq.token_ids = ids[:n]
        drafts.append(b.can_draft(seq))
    assert drafts[0] and not all(drafts[1:-1]) and drafts[-1]
    fallback = gemma.token_to_id("<0x41>")
    assert fallback not in set(b.draft_ids.tolist())  # "A" is shared through Gemma's ordinary "A"
    feed(b, ids)


def test_a_re_encoding_that_changes_an_earlier_token_rewinds_the_draft_cache(tokenizers):
    """Fed one character at a time, 'hello' is re-encoded into longer tokens: the cache agrees only up to the first
    draft token that changed."""
    qwen, smol = tokenizers["qwen2.5-coder-0.5b"], tokenizers["smollm2-135m"]
    b = bridge(tokenizers, "smollm2-135m")
    ids = [qwen.encode(c, add_special_tokens=False)[0] for c in "say hello"]  # a token per character
    views = feed(b, ids)
    assert views[-2] != views[-1][: len(views[-2])]  # appending 'o' changed an earlier draft token
    kv = SequenceKV(num_cached=len(views[-2]), tokens=list(views[-2]))
    first_change = next(i for i, (x, y) in enumerate(zip(views[-2], views[-1])) if x != y)
    assert b.agree(kv, views[-1]) == first_change
    assert views[-1] == smol.encode("say hello", add_special_tokens=False)


def test_building_the_map_is_fast_and_cached(tokenizers):
    import time
    qwen, gemma = tokenizers["qwen2.5-coder-0.5b"], tokenizers["gemma3-270m"]
    bridge(tokenizers, "gemma3-270m")
    t0 = time.perf_counter()
    bridge(tokenizers, "gemma3-270m")
    assert time.perf_counter() - t0 < 2.0  # cached: no second byte-string join over 262k + 152k tokens
    assert len(shared_tokens(qwen, gemma)[0]) > 90_000


# ---- real models: SmolLM2-135M and Gemma 3 270M drafting for Qwen2.5-Coder-0.5B ------------------------------
@pytest.fixture(scope="module")
def qwen_plain(tokenizers):
    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "The three primary colors are", "Übersetze ins Englische: 'Guten Morgen, wie geht es dir?' 🙂"]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    plain = [o.token_ids for o in LLM("qwen2.5-coder-0.5b", kv_cache_memory="256MiB", max_model_len=4096
                                      ).generate(prompts, greedy)]
    return prompts, greedy, plain


@pytest.mark.parametrize("draft", ["smollm2-135m", "gemma3-270m"])
def test_greedy_real_models_equal_the_target_alone(qwen_plain, draft):
    prompts, greedy, plain = qwen_plain
    # k fixed: the cost model would leave a draft this close in size to the target mostly off
    llm = LLM("qwen2.5-coder-0.5b", draft=draft, num_speculative_tokens=3, kv_cache_memory="256MiB",
              max_model_len=4096)
    assert "drafts for qwen2.5-coder-0.5b over" in llm.loaded.draft_pairing
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
    assert [llm.generate([p], greedy)[0].token_ids for p in prompts] == plain
    stats = llm.spec_stats
    # the draft reads the text as its tokenizer writes it (Gemma 3 270M is a base model: it agrees less often)
    assert stats.accepted_tokens > stats.draft_tokens * {"smollm2-135m": 0.25, "gemma3-270m": 0.1}[draft]


def test_a_session_with_a_cross_vocabulary_draft_resumes_from_its_snapshot(qwen_plain, tmp_path):
    options = {"kv_cache_memory": "256MiB", "max_model_len": 4096}
    llm = LLM("qwen2.5-coder-0.5b", draft="smollm2-135m", num_speculative_tokens=3, **options)
    plain = LLM("qwen2.5-coder-0.5b", **options)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    first, second = {"role": "user", "content": "Name a prime number."}, {"role": "user", "content": "Another?"}
    with llm.session() as s, plain.session() as ref:
        assert s.chat(first, params).text == ref.chat(first, params).text
        s.save(tmp_path / "s.qds")
        key = llm.drafter.key
        held = list(s.kv[key].tokens[: s.kv[key].num_cached])
        assert held
    with llm.load_session(tmp_path / "s.qds") as s2, plain.session() as ref:
        assert s2.kv[key].tokens == held  # the draft's view came back with its cache
        ref.chat(first, params)
        assert s2.chat(second, params).text == ref.chat(second, params).text
        assert llm.spec_stats.accepted_tokens > 0
