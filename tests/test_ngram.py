"""N-gram (prompt lookup) drafting's index (speculative/drafters.py): as a sequence grows, its lookup must give what
a scan of the whole context gives (the latest earlier occurrence of the last n tokens, largest n first), whatever the
n-gram sizes; a list replaced or cut is read again; a sequence's index goes with release() or with the sequence.
And a cap of no drafts decodes plainly."""
from __future__ import annotations

import gc
import random

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.speculative.drafters import NgramDrafter, NgramIndex

try:
    from test_speculative import TINY_KV, tiny_prompts
except ImportError:  # tests/ imported as a package
    from tests.test_speculative import TINY_KV, tiny_prompts


def scan(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The lookup by a scan of every earlier window (what each step used to do)."""
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        pattern = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == pattern]
        if starts:
            follow = starts[-1] + n
            return tokens[follow:follow + k]
    return []


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 4), (2, 3), (3, 3), (1, 1)])
def test_the_index_finds_what_a_scan_finds_as_the_list_grows(min_ngram, max_ngram):
    rng = random.Random(min_ngram * 10 + max_ngram)
    for vocab in (3, 8, 50):  # few ids: many repeats and long matches; many: few
        tokens: list[int] = []
        index = NgramIndex(min_ngram, max_ngram)
        for _ in range(300):
            tokens.extend(rng.randrange(vocab) for _ in range(rng.choice((1, 1, 2, 5))))
            k = rng.randrange(0, 6)
            assert index.lookup(tokens, k) == scan(tokens, k, min_ngram, max_ngram), (vocab, len(tokens))


def test_large_ids_and_a_list_replaced_or_cut():
    index = NgramIndex(1, 4)
    big = [2**31 + 5, 7, 2**31 + 5, 7, 9, 2**31 + 5, 7]
    assert index.lookup(big, 3) == scan(big, 3, 1, 4) == [9, 2**31 + 5, 7]
    other = [1, 2, 3, 1, 2]
    assert index.lookup(other, 2) == [3, 1]  # another list object: read from its start
    other[3:] = [4, 4]  # cut and regrown to the same length
    assert index.lookup(other, 2) == scan(other, 2, 1, 4)
    del other[2:]
    assert index.lookup(other, 2) == scan(other, 2, 1, 4) == []


class Seq:
    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = tokens


def test_a_sequences_index_goes_with_release_or_with_the_sequence():
    drafter = NgramDrafter()
    a, b = Seq([1, 2, 3, 1, 2]), Seq([5, 6, 5])
    assert [p.tokens for p in drafter.propose([a, b], [2, 2])] == [[3, 1], [6, 5]]
    a.token_ids.append(3)
    assert drafter.propose([a], [3])[0].tokens == [1, 2, 3]
    assert len(drafter._indexes) == 2
    drafter.release(a)
    assert len(drafter._indexes) == 1
    del b
    gc.collect()
    assert not drafter._indexes


def test_speculation_capped_at_no_drafts_decodes_plainly(tiny_dir):
    """``max_speculative_tokens=0`` with k chosen per step: no drafts (and no probes), the plain tokens."""
    model = str(tiny_dir(arch="qwen2", vocab_size=64))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = tiny_prompts(64, 2)
    plain = [o.token_ids for o in LLM(model, dtype="float32", kv_cache_memory=TINY_KV).generate(prompts, params)]
    capped = LLM(model, dtype="float32", kv_cache_memory=TINY_KV, speculative="ngram", max_speculative_tokens=0)
    assert [o.token_ids for o in capped.generate(prompts, params)] == plain
    assert capped.spec_stats.draft_tokens == 0
