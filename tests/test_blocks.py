"""Block bookkeeping of the paged KV cache (kv/blocks.py), on a tiny pool: reference counts, the prefix cache,
copy-on-write, rewinds, forks and hidden tokens. A leaked or wrongly shared block corrupts another request's
output or starves the pool, so every test checks the counts the allocator ends with."""
from __future__ import annotations

import pytest
import torch

from quickdraft.kv import BlockAllocator, KVPool, OutOfBlocks, SequenceKV
from quickdraft.kv.attention import PREFILL_CELL
from quickdraft.kv.blocks import block_hash

BS = 32  # two blocks a cell: prefix matches are cut back to whole cells


def make_pool(num_blocks: int = 8, block_size: int = BS) -> tuple[KVPool, BlockAllocator]:
    return KVPool(1, 1, 2, num_blocks, block_size, torch.float32, "cpu"), BlockAllocator(num_blocks)


def filled(length: int, allocator: BlockAllocator, block_size: int = BS) -> SequenceKV:
    """A sequence whose first ``length`` tokens are cached."""
    kv = SequenceKV()
    kv.reserve(length, allocator, block_size)
    kv.num_cached = length
    return kv


def published(tokens: list[int], allocator: BlockAllocator) -> SequenceKV:
    kv = filled(len(tokens), allocator)
    kv.publish(tokens, allocator, BS)
    return kv


def test_share_and_release_count_owners_and_free_only_at_zero():
    _, alloc = make_pool(4)
    block = alloc.allocate()
    assert alloc.ref_counts[block] == 1 and alloc.num_free == 3
    alloc.share(block)
    alloc.release(block)
    assert alloc.ref_counts[block] == 1 and alloc.num_used == 1  # one owner left: still in use
    alloc.release(block)
    assert alloc.ref_counts[block] == 0 and alloc.num_free == 4


def test_least_recently_freed_cached_block_is_handed_out_first():
    """Recently freed blocks keep their cached content longest; blocks without content go first, lowest id first."""
    _, alloc = make_pool(5)
    a, b, c, d = (alloc.allocate() for _ in range(4))
    for block, digest in ((a, b"a"), (b, b"b"), (c, b"c")):
        alloc.register(block, digest)
    alloc.release(b)
    alloc.release(a)
    alloc.release(c)
    alloc.release(d)
    assert alloc.allocate() == d  # no content to keep
    assert alloc.allocate() == 4  # a block never used: memory grows before a cached prefix is given up
    assert [alloc.allocate() for _ in range(3)] == [b, a, c]
    assert alloc.lookup(b"b") is None  # handed out again: no longer a cached prefix


def test_memory_grows_only_with_use_and_trim_gives_it_back():
    pool, alloc = make_pool(8)
    blocks = [alloc.allocate() for _ in range(3)]
    assert blocks == [0, 1, 2] and alloc.high_water == 3
    alloc.release(blocks[0])
    assert alloc.allocate() == 0 and alloc.high_water == 3  # a freed block is reused before a new one is touched
    alloc.register(1, b"cached")
    alloc.release(2)
    alloc.release(1)
    assert alloc.trim() == 2  # block 1 holds a cached prefix, block 0 is in use; block 2 is given back
    assert alloc.num_free == 7
    alloc.reset_prefix_cache()
    alloc.release(0)
    assert alloc.trim() == 0 and alloc.num_free == 8
    assert [alloc.allocate() for _ in range(8)] == list(range(8))


def test_reserve_is_all_or_nothing():
    _, alloc = make_pool(3)
    kv = filled(BS, alloc)
    with pytest.raises(OutOfBlocks):
        kv.reserve(4 * BS, alloc, BS)  # needs 3 more, 2 free
    assert len(kv.block_table) == 1 and alloc.num_free == 2
    kv.reserve(3 * BS, alloc, BS)
    assert len(kv.block_table) == 3 and alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate()


def test_publish_registers_only_full_committed_blocks():
    _, alloc = make_pool()
    tokens = list(range(1, 3 * BS + 6))
    kv = filled(len(tokens), alloc)
    kv.num_cached = 2 * BS + 3  # the rest is not committed yet
    kv.publish(tokens, alloc, BS)
    assert len(kv.hashes) == 2
    first = block_hash(b"", tokens[:BS])
    assert alloc.lookup(first) == kv.block_table[0]
    assert alloc.lookup(block_hash(first, tokens[BS:2 * BS])) == kv.block_table[1]
    kv.publish(tokens[:BS + 1], alloc, BS)  # fewer committed tokens than cached: no more than they fill
    assert len(kv.hashes) == 2


def test_match_prefix_takes_cached_blocks_and_leaves_a_token_to_compute():
    _, alloc = make_pool()
    tokens = list(range(1, 2 * PREFILL_CELL + 1))
    owner = published(tokens, alloc)
    used = alloc.num_used
    kv = SequenceKV()
    assert kv.match_prefix(tokens + [7], alloc, BS) == len(tokens)  # every block of the prompt but its last token
    assert kv.block_table == owner.block_table and kv.hashes == owner.hashes
    assert all(alloc.ref_counts[b] == 2 for b in owner.block_table) and alloc.num_used == used
    same = SequenceKV()
    assert same.match_prefix(tokens, alloc, BS) == PREFILL_CELL  # the last token is computed: back to a cell
    assert alloc.prefix_hit_blocks == 4 + 3 and alloc.prefix_query_blocks == 4 + 3
    assert [alloc.ref_counts[b] for b in owner.block_table] == [3, 3, 2, 2]


def test_match_prefix_stops_at_the_first_different_block():
    """Hashes are chained: an equal block after a different one is not a hit."""
    _, alloc = make_pool()
    tokens = list(range(1, 2 * PREFILL_CELL + 2))
    owner = published(tokens, alloc)
    edited = list(tokens)
    edited[PREFILL_CELL] = 0
    kv = SequenceKV()
    assert kv.match_prefix(edited, alloc, BS) == PREFILL_CELL
    assert kv.block_table == owner.block_table[:2]
    assert SequenceKV().match_prefix([0] + tokens[1:], alloc, BS) == 0
    holder = filled(BS, alloc)  # a sequence that already holds blocks matches nothing
    assert holder.match_prefix(tokens, alloc, BS) == 0 and holder.num_cached == BS


def test_a_block_matches_only_after_the_same_prefix():
    """Equal tokens after a different prefix have other keys and values: block hashes are chained."""
    _, alloc = make_pool()
    tail = list(range(1, BS + 1))
    published([7] * BS + tail, alloc)
    second = published([8] * BS + tail, alloc)
    kv = SequenceKV()
    assert kv.match_prefix([8] * BS + tail + [1], alloc, BS) == 2 * BS
    assert kv.block_table == second.block_table[:2]


def test_match_prefix_starts_at_a_cell_boundary():
    """A prefix hit may not start the computation mid-cell, or the prompt's pieces would differ from a cold run."""
    _, alloc = make_pool()
    tokens = list(range(1, 3 * BS + 2))
    owner = published(tokens, alloc)
    kv = SequenceKV()
    assert kv.match_prefix(tokens, alloc, BS) == PREFILL_CELL  # three full blocks are cached, two are taken
    assert len(kv.block_table) == 2
    assert alloc.ref_counts[owner.block_table[2]] == 1  # the third one went back


def test_match_prefix_below_exact_below_starts_at_any_block():
    """Below ``exact_below`` a token attends alone whatever its chunk: the hit keeps every cached block there; past
    it the computation starts at a cell boundary again."""
    _, alloc = make_pool()
    tokens = list(range(1, 5 * BS + 2))  # five full blocks, two and a half cells
    published(tokens, alloc)
    assert SequenceKV().match_prefix(tokens, alloc, BS, exact_below=4 * PREFILL_CELL) == 5 * BS
    assert SequenceKV().match_prefix(tokens, alloc, BS, exact_below=2 * PREFILL_CELL) == 2 * PREFILL_CELL
    assert SequenceKV().match_prefix(tokens[:3 * BS + 1], alloc, BS, exact_below=2 * PREFILL_CELL) == 3 * BS
    assert SequenceKV().match_prefix(tokens[:3 * BS + 1], alloc, BS, exact_below=PREFILL_CELL) == PREFILL_CELL


def test_make_writable_copies_shared_blocks_and_leaves_the_owner_intact():
    pool, alloc = make_pool()
    parent = filled(BS + 5, alloc)
    pool.k[0, :] = torch.arange(pool.k[0].numel(), dtype=torch.float32).view_as(pool.k[0])
    before = pool.k.clone()
    child = parent.fork(BS + 5, alloc, BS)
    child.make_writable(BS + 5, BS + 6, alloc, pool)  # touches the second block only
    assert child.block_table[0] == parent.block_table[0] and alloc.ref_counts[parent.block_table[0]] == 2
    new, old = child.block_table[1], parent.block_table[1]
    assert new != old and alloc.ref_counts[new] == 1 and alloc.ref_counts[old] == 1
    assert torch.equal(pool.k[0, new * BS:(new + 1) * BS], before[0, old * BS:(old + 1) * BS])
    pool.k[0, new * BS + 5] = -1.0  # the child writes its next token
    assert torch.equal(pool.k[0, old * BS:(old + 1) * BS], before[0, old * BS:(old + 1) * BS])
    free = alloc.num_free
    child.make_writable(BS + 6, BS + 7, alloc, pool)  # its own block now: nothing to copy
    assert child.block_table[1] == new and alloc.num_free == free


def test_truncate_gives_back_whole_blocks_only():
    _, alloc = make_pool()
    kv = filled(3 * BS, alloc)
    table = list(kv.block_table)
    kv.truncate(2 * BS + 1, alloc, BS)  # a speculative rewind inside the last block keeps it
    assert kv.block_table == table and kv.num_cached == 2 * BS + 1 and alloc.num_used == 3
    kv.truncate(2 * BS, alloc, BS)
    assert kv.block_table == table[:2] and alloc.num_used == 2 and alloc.ref_counts[table[2]] == 0
    kv.truncate(5 * BS, alloc, BS)  # longer than cached: nothing is added back
    assert kv.num_cached == 2 * BS and kv.block_table == table[:2]


def test_truncate_into_a_published_block_takes_it_out_of_the_prefix_cache():
    _, alloc = make_pool()
    tokens = list(range(1, 2 * BS + 1))
    kv = published(tokens, alloc)
    first = block_hash(b"", tokens[:BS])
    kv.truncate(BS + 3, alloc, BS)  # the second block will be rewritten from token BS + 3 on
    assert kv.hashes == [first] and alloc.lookup(first) == kv.block_table[0]
    assert alloc.lookup(block_hash(first, tokens[BS:])) is None
    kv.truncate(BS, alloc, BS)  # at a block boundary the blocks below keep their registration
    assert alloc.lookup(first) == kv.block_table[0]


def test_free_releases_every_block_and_shared_ones_stay_with_their_other_owner():
    _, alloc = make_pool()
    parent = filled(2 * BS + 1, alloc)
    child = parent.fork(2 * BS + 1, alloc, BS)
    parent.free(alloc)
    assert parent.block_table == [] and parent.num_cached == 0 and parent.hashes == []
    assert alloc.num_used == 3 and all(alloc.ref_counts[b] == 1 for b in child.block_table)
    child.free(alloc)
    assert alloc.num_free == alloc.num_blocks and not any(alloc.ref_counts)


def test_fork_shares_the_prompt_with_every_sample():
    """n > 1: each sample shares the blocks of the prompt, including a partial last block, until it writes."""
    _, alloc = make_pool()
    tokens = list(range(1, 2 * BS + 6))
    parent = published(tokens, alloc)
    children = [parent.fork(len(tokens), alloc, BS) for _ in range(3)]
    for child in children:
        assert child.block_table == parent.block_table and child.num_cached == len(tokens)
        assert child.hashes == parent.hashes
    assert [alloc.ref_counts[b] for b in parent.block_table] == [4, 4, 4] and alloc.num_used == 3
    short = parent.fork(BS + 1, alloc, BS)
    assert short.block_table == parent.block_table[:2] and short.num_cached == BS + 1
    assert short.hashes == parent.hashes[:1]
    assert parent.fork(10 * BS, alloc, BS).num_cached == len(tokens)  # never more than the parent holds


def test_reset_prefix_cache_forgets_free_blocks_only():
    _, alloc = make_pool()
    kept = list(range(1, BS + 1))
    dropped = list(range(2, BS + 2))
    live = published(kept, alloc)
    published(dropped, alloc).free(alloc)
    alloc.reset_prefix_cache()
    assert alloc.lookup(block_hash(b"", dropped)) is None
    assert alloc.lookup(block_hash(b"", kept)) == live.block_table[0]  # its sequence still holds it


def test_a_freed_block_serves_hits_until_it_is_handed_out_again():
    _, alloc = make_pool(2)
    tokens = list(range(1, BS + 1))
    digest = block_hash(b"", tokens)
    block = published(tokens, alloc).block_table[0]
    alloc.release(block)
    assert alloc.lookup(digest) == block and alloc.share(block) == block and alloc.num_free == 1
    alloc.release(block)
    alloc.allocate()  # the never-used block goes first
    assert alloc.lookup(digest) == block
    alloc.allocate()
    assert alloc.lookup(digest) is None  # its content is about to be overwritten


def test_hide_keeps_blocks_and_reveal_takes_them_back():
    _, alloc = make_pool()
    kv = filled(BS + 10, alloc)
    table = list(kv.block_table)
    kv.hide(BS - 2)
    assert kv.num_cached == BS - 2 and kv.block_table == table and alloc.num_used == 2
    kv.reveal(BS + 10, BS)
    assert kv.num_cached == BS + 10
    with pytest.raises(ValueError):
        kv.reveal(2 * BS + 1, BS)
    kv.hide(4 * BS)  # hiding never adds tokens
    assert kv.num_cached == BS + 10
