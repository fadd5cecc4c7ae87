"""The continuous-batching scheduler (engine/scheduler.py) over a real ModelRunner of a tiny random model and real
Sequences: admission order per policy, the step's token budget and sequence limit, chunked prefill at cell
boundaries, running before waiting, preemption (which sequence, recompute or swap) and room kept for drafts."""
from __future__ import annotations

import pytest
import torch

from quickdraft.config import ModelConfig
from quickdraft.engine.scheduler import Scheduler, SchedulerConfig
from quickdraft.engine.sequence import Sequence, Status
from quickdraft.kv import ForwardItem, KVPool, ModelRunner
from quickdraft.kv.attention import PREFILL_CELL
from quickdraft.models import Transformer
from quickdraft.sampling import LogitsProcessor, SamplingParams
from quickdraft.tokenizer import Tokenizer

try:
    from conftest import write_word_tokenizer
except ImportError:  # tests/ imported as a package
    from tests.conftest import write_word_tokenizer

VOCAB, BS = 32, 4
CFG = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("words")
    write_word_tokenizer(path, VOCAB)
    return Tokenizer.from_hf_dir(path)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def make_runner(model: Transformer, num_blocks: int, block_size: int = BS) -> ModelRunner:
    per_block = KVPool.bytes_per_block(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, block_size, torch.float32)
    return ModelRunner("target", model, num_blocks * per_block, block_size=block_size)


def make_scheduler(runner: ModelRunner, **config) -> Scheduler:
    """With the engine's recompute hook: a preempted sequence's KV is dropped."""
    return Scheduler(SchedulerConfig(**config), runner, on_preempt=lambda seq: runner.free(seq.kv["target"]))


def make_seq(tokenizer: Tokenizer, name: str, prompt: int | list[int], arrival: float, **params) -> Sequence:
    """``prompt``: the prompt's token ids, or how many (never id 0, the <eos>)."""
    sampling = SamplingParams(max_tokens=params.pop("max_tokens", 50), **params)
    if isinstance(prompt, int):
        prompt = [1 + i * 7 % (VOCAB - 1) for i in range(prompt)]
    return Sequence(request_id=name, index=0, prompt=None, prompt_ids=prompt, params=sampling, tokenizer=tokenizer,
                    processor=LogitsProcessor(sampling, prompt, VOCAB), generator=torch.Generator(),
                    max_model_len=1024, arrival_s=arrival)


def step(scheduler: Scheduler, runner: ModelRunner, draft_room: int = 0) -> list[tuple[str, int]]:
    """Schedule one step and run it as the engine does: each sequence that has its whole context cached decodes a
    token. Returns (request id, new tokens) in scheduled order."""
    scheduled = scheduler.schedule(draft_room)
    items = [ForwardItem(seq.kv["target"], seq.token_ids[seq.kv["target"].num_cached:][:n], 1) for seq, n in scheduled]
    if items:
        runner.forward(items)
    for seq, _ in scheduled:
        if seq.kv["target"].num_cached == seq.num_tokens:
            seq.append([1], [False])
    return [(seq.request_id, n) for seq, n in scheduled]


def admitted(tokenizer, model, policy: str, seqs: list[dict]) -> list[str]:
    runner = make_runner(model, 64)
    scheduler = make_scheduler(runner, policy=policy, max_num_seqs=2)
    for i, kwargs in enumerate(seqs):
        scheduler.add(make_seq(tokenizer, f"s{i}", **kwargs))
    return [name for name, _ in step(scheduler, runner)]


def test_fcfs_admits_in_arrival_order(tokenizer, model):
    seqs = [{"prompt": 3, "arrival": 2.0}, {"prompt": 3, "arrival": 0.5}, {"prompt": 3, "arrival": 1.0}]
    assert admitted(tokenizer, model, "fcfs", seqs) == ["s1", "s2"]


def test_sjf_admits_the_shortest_job_first(tokenizer, model):
    """A job's length is its prompt plus max_tokens; ties go by arrival."""
    seqs = [{"prompt": 3, "arrival": 0.0, "max_tokens": 40}, {"prompt": 20, "arrival": 1.0, "max_tokens": 5},
            {"prompt": 10, "arrival": 2.0, "max_tokens": 15}, {"prompt": 5, "arrival": 3.0, "max_tokens": 41}]
    assert admitted(tokenizer, model, "sjf", seqs) == ["s1", "s2"]


def test_priority_admits_the_smallest_priority_value_first(tokenizer, model):
    seqs = [{"prompt": 3, "arrival": 0.0, "priority": 5}, {"prompt": 3, "arrival": 1.0, "priority": -1},
            {"prompt": 3, "arrival": 2.0, "priority": 5}, {"prompt": 3, "arrival": 3.0, "priority": 0}]
    assert admitted(tokenizer, model, "priority", seqs) == ["s1", "s3"]


def test_deadline_admits_the_earliest_deadline_first_and_none_last(tokenizer, model):
    seqs = [{"prompt": 3, "arrival": 0.0}, {"prompt": 3, "arrival": 1.0, "deadline_s": 9.0},
            {"prompt": 3, "arrival": 2.0, "deadline_s": 3.0}]
    assert admitted(tokenizer, model, "deadline", seqs) == ["s2", "s1"]


def test_token_budget_and_max_num_seqs_bound_a_step(tokenizer, model):
    runner = make_runner(model, 64)
    scheduler = make_scheduler(runner, max_num_batched_tokens=25, max_num_seqs=3)
    for i in range(4):
        scheduler.add(make_seq(tokenizer, f"s{i}", 10, float(i)))
    assert step(scheduler, runner) == [("s0", 10), ("s1", 10)]  # s2's 10 tokens do not fit in the 5 left
    assert step(scheduler, runner) == [("s0", 1), ("s1", 1), ("s2", 10)]
    assert step(scheduler, runner) == [("s0", 1), ("s1", 1), ("s2", 1)]  # s3 waits: three are running
    assert [s.request_id for s in scheduler.waiting] == ["s3"] and scheduler.waiting[0].status is Status.WAITING


def test_a_long_prompt_is_prefilled_in_chunks_ending_at_cell_boundaries(tokenizer, model):
    runner = make_runner(model, 128)
    scheduler = make_scheduler(runner, max_num_batched_tokens=100)
    scheduler.add(make_seq(tokenizer, "long", 2 * PREFILL_CELL + 72, 0.0))
    scheduler.add(make_seq(tokenizer, "short", 30, 1.0))
    assert step(scheduler, runner) == [("long", PREFILL_CELL), ("short", 30)]  # 100 tokens would end mid-cell
    assert step(scheduler, runner) == [("long", PREFILL_CELL), ("short", 1)]
    assert step(scheduler, runner) == [("long", 72), ("short", 1)]  # the rest fits: the last chunk ends anywhere
    assert step(scheduler, runner) == [("long", 1), ("short", 1)]


def test_a_step_with_its_whole_budget_free_always_makes_progress(tokenizer, model):
    """A budget that cannot reach a cell boundary still takes what fits when nothing else is in the step; the next
    chunk gets back to a boundary."""
    runner = make_runner(model, 64)
    scheduler = make_scheduler(runner, max_num_batched_tokens=50)
    scheduler.add(make_seq(tokenizer, "long", 120, 0.0))
    chunks = [step(scheduler, runner)[0][1] for _ in range(4)]
    assert chunks == [50, PREFILL_CELL - 50, 50, 120 - PREFILL_CELL - 50]


def test_running_sequences_are_scheduled_before_waiting_ones(tokenizer, model):
    """A newly arrived request of higher priority does not take the step from sequences already running."""
    runner = make_runner(model, 64)
    scheduler = make_scheduler(runner, policy="priority", max_num_batched_tokens=8)
    scheduler.add(make_seq(tokenizer, "low", 6, 0.0, priority=9))
    assert step(scheduler, runner) == [("low", 6)]
    scheduler.add(make_seq(tokenizer, "high", 8, 1.0, priority=0))
    assert step(scheduler, runner) == [("low", 1)]  # high's 8 tokens do not fit in the 7 left
    assert scheduler.waiting[0].request_id == "high"


def fill(tokenizer, model, preemption: str = "recompute") -> tuple:
    """Three running sequences whose 8-token prompts fill all 6 blocks; each next token needs a new block."""
    runner = make_runner(model, 6)
    scheduler = make_scheduler(runner, preemption=preemption)
    seqs = [make_seq(tokenizer, name, 8, float(i)) for i, name in enumerate("abc")]
    for seq in seqs:
        scheduler.add(seq)
    assert step(scheduler, runner) == [("a", 8), ("b", 8), ("c", 8)] and runner.allocator.num_free == 0
    return runner, scheduler, seqs


def test_the_lowest_ranked_running_sequence_is_preempted_and_recomputed(tokenizer, model):
    runner, scheduler, (a, _, c) = fill(tokenizer, model)
    tokens = list(c.token_ids)
    assert step(scheduler, runner) == [("a", 1), ("b", 1)]
    assert scheduler.num_preemptions == 1 and c.status is Status.WAITING and scheduler.waiting == [c]
    assert c.kv["target"].block_table == [] and c.kv["target"].num_cached == 0 and c.swapped is None
    assert c.token_ids == tokens  # committed tokens stay: it is recomputed, not restarted
    runner.free(a.kv["target"])
    scheduler.remove(a)
    assert step(scheduler, runner) == [("b", 1), ("c", 9)]


def test_preemption_follows_the_policy_not_admission_order(tokenizer, model):
    """A later request of higher priority runs first and keeps its blocks: the lower one is preempted."""
    runner = make_runner(model, 4)
    scheduler = make_scheduler(runner, policy="priority")
    low, high = make_seq(tokenizer, "low", 7, 0.0, priority=5), make_seq(tokenizer, "high", 8, 1.0, priority=0)
    scheduler.add(low)
    assert step(scheduler, runner) == [("low", 7)]
    scheduler.add(high)
    assert step(scheduler, runner) == [("low", 1), ("high", 8)] and runner.allocator.num_free == 0
    assert step(scheduler, runner) == [("high", 1)]
    assert scheduler.waiting == [low] and low.kv["target"].block_table == []


def test_a_sequence_that_does_not_fit_preempts_itself_not_a_higher_ranked_one(tokenizer, model):
    runner = make_runner(model, 3)
    scheduler = make_scheduler(runner)
    a, b = make_seq(tokenizer, "a", 6, 0.0), make_seq(tokenizer, "b", 4, 1.0)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler, runner) == [("a", 6), ("b", 4)] and runner.allocator.num_free == 0
    assert step(scheduler, runner) == [("a", 1)]  # a's next token fits its blocks; b's needs one more
    assert scheduler.running == [a] and scheduler.waiting == [b] and len(a.kv["target"].block_table) == 2


def test_blocks_a_running_sequence_needs_are_not_given_to_waiting_ones(tokenizer, model):
    runner = make_runner(model, 4)
    scheduler = make_scheduler(runner)
    scheduler.add(make_seq(tokenizer, "a", 4, 0.0))
    assert step(scheduler, runner) == [("a", 4)]
    scheduler.add(make_seq(tokenizer, "b", 12, 1.0))
    assert step(scheduler, runner) == [("a", 1)]  # a's token takes a second block: b's three do not fit in two


def test_swap_preemption_keeps_the_kv_in_host_memory_and_brings_it_back(tokenizer, model):
    runner, scheduler, (a, _, c) = fill(tokenizer, model, preemption="swap")
    before = runner.gather(c.kv["target"])
    assert step(scheduler, runner) == [("a", 1), ("b", 1)]
    assert c.swapped is not None and c.swapped[1] == 8 and c.kv["target"].block_table == []
    runner.free(a.kv["target"])
    scheduler.remove(a)
    assert step(scheduler, runner) == [("b", 1), ("c", 1)]  # only its uncached token: nothing is recomputed
    assert c.swapped is None
    after = runner.gather(c.kv["target"])
    assert set(after) == {"k", "v"} and all(torch.equal(after[name][:, :8], before[name]) for name in before)


def test_draft_room_is_reserved_for_every_scheduled_sequence(tokenizer, model):
    def run(draft_room: int) -> list[tuple[str, int]]:
        runner = make_runner(model, 4)
        scheduler = make_scheduler(runner)
        scheduler.add(make_seq(tokenizer, "a", 4, 0.0))
        scheduler.add(make_seq(tokenizer, "b", 4, 1.0))
        return step(scheduler, runner, draft_room)

    assert run(4) == [("a", 4), ("b", 4)]  # 4 + 4 tokens: two blocks each
    assert run(5) == [("a", 4)]  # 4 + 5 tokens: three blocks each, six are not there


def test_draft_room_counts_for_running_sequences_too(tokenizer, model):
    runner = make_runner(model, 4)
    scheduler = make_scheduler(runner)
    scheduler.add(make_seq(tokenizer, "a", 4, 0.0))
    scheduler.add(make_seq(tokenizer, "b", 4, 1.0))
    assert step(scheduler, runner) == [("a", 4), ("b", 4)]
    assert step(scheduler, runner, draft_room=4) == [("a", 1)]  # 5 + 4 tokens: a takes the two free blocks
    assert [s.request_id for s in scheduler.waiting] == ["b"]


def test_a_cached_prefix_is_not_computed_again(tokenizer, model):
    runner = make_runner(model, 64, block_size=16)
    scheduler = make_scheduler(runner)
    first = make_seq(tokenizer, "a", PREFILL_CELL + 6, 0.0)
    scheduler.add(first)
    step(scheduler, runner)
    runner.publish(first.kv["target"], first.token_ids)
    again = make_seq(tokenizer, "b", first.prompt_ids[:PREFILL_CELL] + [5, 6, 7], 1.0)
    scheduler.add(again)
    assert step(scheduler, runner) == [("a", 1), ("b", 3)]
    assert again.kv["target"].block_table[:4] == first.kv["target"].block_table[:4]


def test_a_long_prompt_takes_smaller_chunks_while_others_decode(tokenizer, model):
    """prefill_tokens_while_decoding: running streams wait for one short chunk, not a whole budget of prompt; once
    nothing decodes the prompt gets the full budget again."""
    runner = make_runner(model, 256)
    scheduler = make_scheduler(runner, max_num_batched_tokens=512, prefill_tokens_while_decoding=PREFILL_CELL)
    scheduler.add(make_seq(tokenizer, "a", 3, 0.0, max_tokens=4))
    assert step(scheduler, runner) == [("a", 3)]
    scheduler.add(make_seq(tokenizer, "long", 600, 1.0))
    assert step(scheduler, runner) == [("a", 1), ("long", PREFILL_CELL)]  # "a" decodes: one cell of the prompt
    assert step(scheduler, runner) == [("a", 1), ("long", PREFILL_CELL)]
    a = scheduler.running[0]
    scheduler.remove(a)
    runner.free(a.kv["target"])
    assert step(scheduler, runner) == [("long", 600 - 2 * PREFILL_CELL)]  # alone: the rest fits the whole budget


@pytest.mark.parametrize("limit", [0, PREFILL_CELL - 1, 1.5, True])
def test_a_prompt_limit_below_one_cell_is_refused(limit):
    from quickdraft.errors import InvalidParameterError
    with pytest.raises(InvalidParameterError, match="prefill_tokens_while_decoding must be an int >= 64"):
        SchedulerConfig(prefill_tokens_while_decoding=limit)
