"""The engine step: the one decode loop every entry point runs through.

One step = schedule -> draft (batched) -> one batched target forward over
[pending tokens + drafts] of every sequence -> verify -> commit -> rewind caches.
Plain decoding is the same step with no drafts.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from quickdraft.engine.launch_ahead import LaunchAhead
from quickdraft.engine.outputs import SpecMetrics, StreamChunk
from quickdraft.engine.scheduler import Scheduler, SchedulerConfig
from quickdraft.engine.sequence import CarriedState, Sequence, SpeculationState
from quickdraft.engine.threads import ThreadBudget
from quickdraft.engine.verify_step import decide
from quickdraft.errors import InvalidParameterError, PromptTooLongError
from quickdraft.kv import ForwardItem, ModelRunner, SequenceKV
from quickdraft.sampling import LogitsProcessor, SamplingParams, vocabulary_inputs
from quickdraft.sampling.grammar import GrammarViolation, compiler_for
from quickdraft.sampling.sampler import make_generator, top_logprobs
from quickdraft.speculative.controller import SpeculationController
from quickdraft.speculative.cost import CostModel
from quickdraft.models import expert_read, weight_bytes
from quickdraft.speculative.drafters import Drafter, Proposal
from quickdraft.speculative.planner import DraftPlanner, fit_to_grammar
from quickdraft.tokenizer import Tokenizer

log = logging.getLogger("quickdraft.engine")

# The most tokens the grammar may force after a constrained sequence's drafts in one round.
FORCED_ROOM = 8


@dataclass
class EngineConfig:
    max_model_len: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_speculative_tokens: int | str = "auto"  # fixed k, or "auto" for the adaptive controller
    max_speculative_tokens: int = 8
    threads: int | str = "auto"  # CPU threads per step, "auto": the cores other processes leave free (ThreadBudget)
    launch_ahead: str = "auto"  # queue the next decode step before reading this one's tokens (see launch_ahead.py)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        check_speculative_tokens(k)
        if k != "auto":
            self.max_speculative_tokens = k


def check_speculative_tokens(k: int | str) -> None:
    """``num_speculative_tokens``: ``'auto'`` or an int in 0..32."""
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 32):
        raise InvalidParameterError(f"num_speculative_tokens must be 'auto' or an int in 0..32, got {k!r}")


class LLMEngine:
    def __init__(self, target: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 drafter: Drafter | None = None) -> None:
        self.target, self.tokenizer, self.config, self.drafter = target, tokenizer, config, drafter
        # the ids that can be prompted, biased and sampled: a checkpoint may pad its embedding past the tokenizer's
        self.vocab_size = min(tokenizer.vocab_size, target.vocab_size)
        target.mask_logits_from(self.vocab_size)
        self.scheduler = Scheduler(config.scheduler, target, on_preempt=self._drop_kv)
        self.threads = ThreadBudget(config.threads)
        self.cost = CostModel()
        fixed = None if config.num_speculative_tokens == "auto" else config.num_speculative_tokens
        self.controller = SpeculationController(self.cost, max_k=config.max_speculative_tokens, fixed_k=fixed,
                                                draft_is_free=drafter is not None and drafter.is_free,
                                                seeded_cost=CostModel.from_weight_bytes(
                                                    weight_bytes(target.model),
                                                    drafter.step_bytes() if drafter is not None else 0,
                                                    experts=expert_read(target.model)))
        self.planner = DraftPlanner(drafter, self.controller, self.cost, self.vocab_size) if drafter else None
        self.ahead = LaunchAhead(self, config.launch_ahead)
        self.stats = SpecMetrics()
        # the drafter's acceptance over recent rounds of every sequence: an unseeded request starts from it, so a
        # drafter that rarely hits (self-speculation on an untrained model) is not paid a prompt catch-up per request
        self.pooled = SpeculationState()
        self._ids = itertools.count()
        self._groups: dict[str, list[Sequence]] = {}
        self._forks: dict[str, list[Sequence]] = {}
        self._cancel_lock = threading.Lock()
        self._cancelled: set[str] = set()  # request ids cancel() was called for, applied at the next step's start
        if drafter is not None:
            drafter.bind_cancelled(self.is_cancelled)
        for runner in {id(r): r for r in (target, drafter.runner if drafter is not None else None) if r}.values():
            runner.warm_up()  # CUDA graphs captured now, not in a request's first step (nor in calibrate's timings)
        if drafter is not None and fixed is None:
            self.calibrate()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, *, carried: CarriedState | None = None) -> str:
        """Validate and queue a request; raises before any model work if it cannot run.

        ``carried`` (sessions, n=1 only): the KV handles, speculation state and generator the sequence uses
        (shared objects, updated in place), output tokens of an interrupted generation to continue, and
        ``keep_kv``: the engine then never frees those KV blocks when the request finishes or is aborted
        (preemption may still drop them; they are recomputed)."""
        params.validate()
        params.check_vocab(self.vocab_size)
        if not prompt_ids:
            raise InvalidParameterError("prompt must contain at least one token")
        if len(prompt_ids) >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context window is {self.config.max_model_len} tokens "
                f"and at least one must be left for generation")
        if max(prompt_ids) >= self.vocab_size or min(prompt_ids) < 0:
            raise InvalidParameterError(f"prompt token ids must be in [0, {self.vocab_size}): the tokenizer's ids")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidParameterError(f"request id {request_id!r} is already in use")
        if carried is not None and params.n != 1:
            raise InvalidParameterError(f"a session generates one sample per turn (n=1), got n={params.n}")
        # the constraint compiles (or comes from the cache) before anything is queued: a bad one is refused here
        grammar = compiler_for(self.tokenizer).compile(params.structured_outputs) if params.structured_outputs \
            else None
        vocabulary = vocabulary_inputs(self.tokenizer, params)  # DRY's breakers, the bad words' tokens
        seqs = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            seq = Sequence(request_id=request_id, index=index, prompt=prompt, prompt_ids=list(prompt_ids),
                           params=params, tokenizer=self.tokenizer,
                           processor=LogitsProcessor(params, prompt_ids, self.vocab_size,
                                                     grammar=grammar.fork() if grammar and index else grammar,
                                                     eos_ids=self.tokenizer.eos_token_ids, **vocabulary),
                           generator=make_generator(seed, "cpu"), max_model_len=self.config.max_model_len)
            if seed is not None:
                seq.draft_nonce = seed % 2**64
            seq.kv["target"] = self.target.new_kv(params.lora)
            if seed is None:  # a seeded request's plan may not depend on earlier requests: it keeps the fixed prior
                seq.spec = self.pooled.as_prior()
            if carried is not None:
                try:
                    carried.apply(seq)
                except GrammarViolation as exc:  # resuming output the request's own constraint forbids
                    raise InvalidParameterError(f"{params.structured_outputs.source}: the output to continue does "
                                                f"not follow it ({exc})") from None
            seqs.append(seq)
        # extra samples wait until the first has prefilled the prompt, then share its blocks (copy-on-write)
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            self._forks[request_id] = seqs[1:]
        self._groups[request_id] = seqs
        return request_id

    def abort(self, request_id: str) -> None:
        self._forks.pop(request_id, None)
        for seq in self._groups.pop(request_id, []):
            self.scheduler.remove(seq)
            if not seq.finished:
                seq.finish("abort")
            self._drop_kv(seq)

    def sequences(self, request_id: str) -> list[Sequence]:
        return self._groups.get(request_id, [])

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        self._groups.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- cancellation (any thread) ------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """Stop a request from any thread. Returns at once; the drafter (and the run-ahead worker) skip it
        from their next draft forward, the step in progress (if any) completes, and the next step finishes
        every sample with finish_reason "abort", keeping the tokens generated so far (unlike ``abort``, the
        request stays readable through ``sequences`` until ``release``)."""
        with self._cancel_lock:
            self._cancelled.add(request_id)

    def cancel_all(self) -> None:
        """``cancel`` every request in flight now (requests added later are not affected)."""
        ids = tuple(self._groups.copy())  # dict.copy holds the GIL throughout: a snapshot even mid-step
        with self._cancel_lock:
            self._cancelled.update(ids)

    def is_cancelled(self, seq: Sequence) -> bool:
        return seq.request_id in self._cancelled

    def _apply_cancels(self) -> list[StreamChunk]:
        with self._cancel_lock:
            pending, self._cancelled = self._cancelled, set()
        chunks = []
        for rid in pending:  # unknown, released or finished requests are left as they are
            self._forks.pop(rid, None)
            for seq in self._groups.get(rid, []):
                if seq.finished:
                    continue
                self.scheduler.remove(seq)
                seq.finish("abort")
                self._drop_kv(seq)
                chunk = seq.take_chunk()
                if chunk is not None:
                    chunks.append(chunk)
        return chunks

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        cancelled = self._apply_cancels() if self._cancelled else []
        self.threads.apply()
        landed = self.ahead.advance()  # the decode step launched ahead by the last call, if any
        if landed is not None:
            return cancelled + landed
        constrained = any(s.processor.grammar is not None for seqs in self._groups.values() for s in seqs)
        room = (self.controller.max_k if self.drafter is not None else 0) + (FORCED_ROOM if constrained else 0)
        scheduled = self.scheduler.schedule(draft_room=room)
        if not scheduled:
            return cancelled
        if not constrained and self.ahead.starts(scheduled):
            return cancelled + self.ahead.start([seq for seq, _ in scheduled])
        sampling = [s for s, chunk in scheduled if s.kv["target"].num_cached + chunk == s.num_tokens]
        # the plan is for the decode batch: a prompt chunk makes this step's target pass dearer whatever is
        # drafted, and counting it would make drafting look cheap (and start draft catch-ups at high load)
        proposals = self.planner.propose(sampling, base_tokens=len(sampling)) if self.planner else \
            [Proposal([]) for _ in sampling]
        if constrained:
            proposals = [fit_to_grammar(s, p, min(len(p.tokens) + FORCED_ROOM, s.draft_room()))
                         if s.processor.grammar is not None else p for s, p in zip(sampling, proposals)]
        drafts = {id(s): p for s, p in zip(sampling, proposals)}
        items = []
        for seq, chunk in scheduled:
            kv = seq.kv["target"]
            proposal = drafts.get(id(seq))
            tokens = seq.token_ids[kv.num_cached:kv.num_cached + chunk]
            num_logits = 0
            if proposal is not None:
                tokens = tokens + proposal.tokens
                num_logits = 1 + len(proposal.tokens)
            items.append(ForwardItem(kv, tokens, num_logits, seq.prompt_logits_taker(kv.num_cached)))
        with self._run_ahead(sampling, proposals):
            logits = self.target.forward(items)
        self.cost.target.record(sum(len(it.tokens) for it in items), self.target.last_forward_s)
        decided = decide([(seq, rows, drafts[id(seq)]) for (seq, _), rows in zip(scheduled, logits)
                          if id(seq) in drafts], self._isolated)
        for (seq, _), rows in zip(scheduled, logits):
            if id(seq) in decided:
                self._isolated(seq, self._commit, seq, rows, drafts[id(seq)], *decided[id(seq)])
        return cancelled + self._deliver([seq for seq, _ in scheduled])

    def _deliver(self, seqs: list[Sequence]) -> list[StreamChunk]:
        """After a step's commits: publish full blocks, start forked samples, and take each sequence's stream chunk,
        letting go of the finished ones."""
        for seq in seqs:
            kv = seq.kv["target"]
            if not seq.finished or seq.finish_reason != "error":
                self.target.publish(kv, seq.token_ids)
            if seq.request_id in self._forks and kv.num_cached >= len(seq.prompt_ids) - 1:
                self._fork_samples(seq)
        chunks = []
        for seq in seqs:
            chunk = self._isolated(seq, seq.take_chunk)
            if seq.finished:
                self.scheduler.remove(seq)
                self._drop_kv(seq)
                if chunk is None and seq.finish_reason == "error":
                    chunk = seq.take_chunk()
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _isolated(self, seq: Sequence, fn, *args):
        """Run one sequence's part of the step; an error there ends that sequence's request alone (finish_reason
        "error" with the message on its last chunk), and every other sequence of the step goes on unchanged."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to that request's caller
            log.exception("request %s failed in its own part of the step", seq.request_id)
            self._forks.pop(seq.request_id, None)
            for sibling in self._groups.get(seq.request_id, [seq]):
                if not sibling.finished:
                    sibling.fail(f"{type(exc).__name__}: {exc}")
                    if sibling is not seq:
                        self.scheduler.remove(sibling)
                        self._drop_kv(sibling)
            return None

    def _fork_samples(self, parent: Sequence) -> None:
        """Start the other samples of a request on the parent's prompt blocks; each recomputes only the last
        prompt token, into its own copy of the shared last block."""
        for child in self._forks.pop(parent.request_id):
            child.kv["target"] = self.target.fork(parent.kv["target"], len(parent.prompt_ids) - 1)
            self.scheduler.add(child)

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens served from the prefix cache instead of being recomputed."""
        return self.target.allocator.prefix_hit_blocks * self.target.block_size

    @contextlib.contextmanager
    def _run_ahead(self, seqs: list[Sequence], proposals: list[Proposal]) -> Iterator[None]:
        """A run-ahead drafter drafts round t+1 in the background while the body (the target pass of round t)
        runs, and is waited for before anything is committed (see RunAheadDrafter)."""
        if self.drafter is None or not any(p.tokens for p in proposals):
            yield
            return
        with self.drafter.running(seqs, proposals):
            yield
        depth = self.drafter.run_ahead_depth()
        if depth is not None:
            self.cost.record_run_ahead(depth)

    def _commit(self, seq: Sequence, rows: torch.Tensor | None, proposal: Proposal, accepted: int, next_token: int,
                cached_ahead: int = 0) -> None:
        """Append what verification decided (``decide``): the first ``accepted`` drafts and ``next_token``.
        ``cached_ahead``: 1 where a launched-ahead forward already holds the key of ``next_token`` (LaunchAhead)."""
        drafted = proposal.tokens
        new_tokens = drafted[:accepted] + [next_token]
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = top_logprobs(rows[:len(new_tokens), :self.vocab_size], torch.tensor(new_tokens), seq.params.logprobs)
        before = seq.num_output_tokens
        seq.append(new_tokens, [True] * accepted + [False], logprobs)
        produced = seq.num_output_tokens - before
        # forced tokens (the grammar's, after the drafts) are neither drafted nor part of the drafter's acceptance
        num_drafted = proposal.drafted
        accepted_drafts = min(accepted, num_drafted, produced)
        round_stats = SpecMetrics(rounds=1, draft_tokens=num_drafted, accepted_tokens=accepted_drafts,
                                  forced_tokens=max(0, min(accepted, produced) - num_drafted),
                                  drafting_rounds=1 if num_drafted else 0, generated_tokens=produced,
                                  run_ahead_rounds=1 if proposal.reused else 0, run_ahead_tokens=proposal.reused)
        seq.metrics.spec.add(round_stats)
        self.stats.add(round_stats)
        seq.spec.record(num_drafted, min(accepted, num_drafted))
        self.pooled.record(num_drafted, min(accepted, num_drafted), decay=0.99)
        self.target.truncate(seq.kv["target"], seq.num_tokens - 1 + cached_ahead)
        if self.drafter is not None:
            self.drafter.rewind(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        if seq.finished:
            seq.swapped = None
            if seq.keep_kv:  # a session's caches: it frees them on close
                return
        kv = seq.kv.get("target")
        if kv is not None:
            self.target.free(kv)
        if self.drafter is not None:
            self.drafter.release(seq)

    # ---- cost calibration -----------------------------------------------------------------------
    def calibrate(self, context: int = 64, repeats: int = 3) -> None:
        """Time target passes of 1..k+1 tokens, one draft step and the draft's catch-up on ``context`` tokens, so
        the controller starts from measurements.

        Each time is the best of ``repeats`` after an untimed pass of the same kind: the first pass through
        weights memory-mapped from the cache pays page faults, and a draft step priced at twice its cost
        would keep speculation off for good (the controller only refines the draft cost while drafting)."""
        probe_params = SamplingParams(max_tokens=self.controller.max_k + 2, temperature=0.0)

        def probe_sequence(ids: list[int]) -> Sequence:
            seq = Sequence(request_id="calibration", index=0, prompt=None, prompt_ids=ids, params=probe_params,
                           tokenizer=self.tokenizer, processor=LogitsProcessor(probe_params, ids, self.vocab_size),
                           generator=make_generator(0, "cpu"), max_model_len=self.config.max_model_len)
            seq.kv["target"] = SequenceKV()
            return seq

        probe_ids = [i % self.vocab_size for i in range(1, context + 1)]
        kv = SequenceKV()
        self.target.forward([ForwardItem(kv, probe_ids, 0)])
        for n in range(1, self.controller.max_k + 2):
            best = float("inf")
            for _ in range(repeats):  # a verify pass of n tokens computes n logits rows (the LM head is not free)
                self.target.forward([ForwardItem(kv, probe_ids[:n], n)])
                best = min(best, self.target.last_forward_s)
                self.target.truncate(kv, context)
            self.cost.target.record(n, best)
        self.target.free(kv)
        probe = probe_sequence(probe_ids)
        self.drafter.propose([probe], [1])  # warm-up, includes the draft's prefill
        probe.token_ids.append(1)
        self.drafter.propose([probe], [1])  # warm-up of the one-token step (the prefill may run other weights)
        best = float("inf")
        for _ in range(repeats):
            probe.token_ids.append(1)
            t0 = time.perf_counter()
            self.drafter.propose([probe], [1])
            best = min(best, time.perf_counter() - t0)
        self.cost.draft.record(1, best)
        self.drafter.release(probe)
        if self.drafter.runner is None:  # no model: no catch-up to price
            return
        best = float("inf")
        for r in range(repeats):  # catch-ups on prompts not in the draft's prefix cache
            fresh = probe_sequence([(i + 1 + r) % self.vocab_size for i in probe_ids])
            self.drafter.propose([fresh], [1])
            best = min(best, next(s for _, fed, s in self.drafter.forward_costs() if fed > 1))
            self.drafter.release(fresh)
        self.cost.draft_catch_up.record(context, best)
