"""One sample being generated: its tokens, sampling state, KV handles and text."""
from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quickdraft.engine.outputs import CompletionOutput, RequestMetrics, StreamChunk
from quickdraft.kv import SequenceKV
from quickdraft.sampling import LogitsProcessor, SamplingParams
from quickdraft.sampling.sampler import top_logprobs
from quickdraft.speculative.controller import AcceptanceCounts
from quickdraft.tokenizer import StreamingDetokenizer, Tokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpeculationState(AcceptanceCounts):
    """Per-sequence acceptance history the adaptive controller reads (decayed counts)."""

    rounds_off: int = 0  # rounds since speculation was switched off for this sequence
    draft_failed: bool = False  # the drafter raised for this sequence: it decodes plainly from then on


@dataclass
class CarriedState:
    """What a Session carries from turn to turn (and through snapshots) into the sequence of its next turn.

    The objects are shared, not copied: the engine updates them in place as the turn runs."""

    kv: dict[str, SequenceKV]  # "target" and the drafter's key; blocks owned by the session
    spec: SpeculationState
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)  # tokens an interrupted turn already generated
    delivered_chars: int | None = None  # how much of their text the caller already has
    mirostat_mu: float | None = None  # mirostat's state after them, where the turn samples with it
    keep_kv: bool = True

    def apply(self, seq: "Sequence") -> None:
        self.kv.setdefault("target", SequenceKV())
        seq.kv, seq.spec, seq.generator, seq.keep_kv = self.kv, self.spec, self.generator, self.keep_kv
        if self.output_ids:
            seq.resume(self.output_ids, self.delivered_chars, self.mirostat_mu)


@dataclass(eq=False)  # identity: a sequence is found in queues by who it is, not by value
class Sequence:
    request_id: str
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    processor: LogitsProcessor
    generator: torch.Generator
    max_model_len: int
    # keys the draft model's uniforms (see draft_uniform): the seed for a seeded request, so its tokens repeat; else
    # random per request (and per session turn), so no two requests share draft randomness
    draft_nonce: int = field(default_factory=lambda: int.from_bytes(os.urandom(8), "little"))
    arrival_s: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    kv: dict[str, SequenceKV] = field(default_factory=dict)
    spec: SpeculationState = field(default_factory=SpeculationState)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] = field(default_factory=list)  # entry p: prompt token p + 1's (prompt_logits_taker)
    scoring_error: str | None = None  # why scoring the prompt failed (the request fails at its first token)
    swapped: tuple | None = None  # host copy of the target KV while preempted with preemption="swap"
    keep_kv: bool = False  # the KV handles belong to a Session: not freed when finished or aborted
    text: str = ""
    error: str | None = None  # why the sequence failed (finish_reason "error")
    stop_string: str | None = None  # the stop string that finished it
    _emitted_tokens: int = 0
    _emitted_chars: int = 0
    _from_draft: list[bool] = field(default_factory=list)
    _text_ends: list[int] = field(default_factory=list)  # per output token: len(text) once it was added
    _spanned: int = 0  # output tokens whose spans went out in a chunk
    _base_tokens: int = 0  # output tokens generated before a resume (not returned again)
    _base_chars: int = 0  # characters of text delivered before a resume
    _prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.metrics.prompt_tokens = len(self.prompt_ids)
        self.detokenizer = StreamingDetokenizer(self.tokenizer, skip_special_tokens=self.params.skip_special_tokens)
        self._stop_strings = self.params.stop or []
        self._holdback = max((len(s) - 1 for s in self._stop_strings), default=0)
        # where stop strings are looked for: [start, end) spans of text, the last open (end None) while it grows; with
        # stop_strings_after_token the first ends at the first special token (an output with none, as a grammar's
        # JSON, is searched whole)
        self._stop_spans: list[list[int | None]] = [[0, None]]
        # with min_tokens, a stop string must end past this many characters: in the text of the min_tokens-th token or
        # later (vLLM's rule), never earlier
        self._stop_floor = 0

    def draft_room(self) -> int:
        """The most tokens a round may draft for this sequence: what fits its context and max_tokens, within its
        request's own cap (``SamplingParams.speculative``); none once the drafter failed for it."""
        if self.spec.draft_failed:
            return 0
        room = min(self.max_model_len - self.num_tokens - 1, self.params.max_tokens - self.num_output_tokens - 1)
        cap = self.params.max_draft_tokens
        return max(0, room if cap is None else min(room, cap))

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt logprobs are still to be computed: asked for, not all there yet, and this is the
        request's first sample (the others fork from its prompt; ``prompt_logprobs_out``)."""
        return (self.params.prompt_logprobs is not None and self.index == 0 and self.scoring_error is None
                and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    def prompt_logits_taker(self, start: int) -> Callable[[int, torch.Tensor | Exception], None] | None:
        """What takes the logits rows of a forward from position ``start`` (``ForwardItem.prompt_logits``) while
        ``scores_prompt``: each row scores the prompt token after it (the last prompt token's row predicts the
        first output token: not a prompt logprob). Positions stored already (a prompt recomputed after a
        preemption) are not stored again. It never raises, as it runs inside the step's shared forward: a failure
        is kept and fails this request alone at its first token (``append``)."""
        last = len(self.prompt_ids) - 1
        if not self.scores_prompt or start >= last:
            return None

        def take(first: int, rows: torch.Tensor | Exception) -> None:
            if self.scoring_error is not None:
                return
            if isinstance(rows, Exception):
                self.scoring_error = f"scoring the prompt failed: {type(rows).__name__}: {rows}"
                return
            begin = max(start + first, len(self.prompt_logprobs))
            end = min(start + first + len(rows), last)
            if begin >= end:
                return
            try:
                chosen = torch.tensor(self.prompt_ids[begin + 1:end + 1])
                picked = rows[begin - start - first:end - start - first]
                self.prompt_logprobs.extend(top_logprobs(picked, chosen, self.params.prompt_logprobs))
            except Exception as exc:  # noqa: BLE001 - reported to this request's caller alone
                self.scoring_error = f"scoring the prompt failed: {type(exc).__name__}: {exc}"
        return take

    def resume(self, output_ids: list[int], delivered_chars: int | None = None,
               mirostat_mu: float | None = None) -> None:
        """Continue an interrupted generation whose first ``output_ids`` were generated earlier (perhaps in
        another process): they count towards ``max_tokens``, feed the penalties and the detokenizer, and stop
        strings spanning the cut are still found, but they are not returned again. ``delivered_chars``: how
        much of their text the caller already has (default all of it that was complete); ``mirostat_mu``: mirostat's
        state after them (where the request samples with it: its tokens alone do not give it)."""
        if len(self.token_ids) != len(self.prompt_ids) or self.metrics.ttft_s is not None:
            raise RuntimeError("resume() must be called on a sequence that has not generated anything yet")
        self.token_ids.extend(output_ids)
        self._from_draft.extend([False] * len(output_ids))
        self.processor.accept(output_ids)
        if self.processor.mirostat is not None:
            self.processor.mirostat.restart(mirostat_mu)
        if self.params.logprobs is not None:
            self.logprobs.extend({} for _ in output_ids)  # placeholders; only the new tokens are returned
        for n_out, token in enumerate(output_ids, 1):
            before = len(self.text)
            self.text += self.detokenizer.add(token)
            self._text_ends.append(len(self.text))
            if self._stop_strings and self.params.stop_strings_after_token is not None:
                self._mark_stop_span(token, before)
            if n_out == self.params.min_tokens:
                self._stop_floor = before
        chars = len(self.text) if delivered_chars is None else max(0, min(delivered_chars, len(self.text)))
        self._base_tokens = self._emitted_tokens = self._spanned = len(output_ids)
        self._base_chars = self._emitted_chars = chars

    @property
    def delivered_chars(self) -> int:
        """Characters of ``text`` handed out by ``take_chunk`` so far (what a streaming caller has seen)."""
        return self._emitted_chars

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        """``len(output_ids)`` without the copy (asked of every sequence every step)."""
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, tokens: list[int], from_draft: list[bool], logprobs: list[dict] | None = None) -> None:
        """Commit generated tokens one by one, stopping at the first stop condition."""
        if self.metrics.ttft_s is None:
            self.metrics.ttft_s = time.perf_counter() - self.arrival_s
        if self.scoring_error is not None:
            raise RuntimeError(self.scoring_error)
        params = self.params
        for i, (token, drafted) in enumerate(zip(tokens, from_draft)):
            self.token_ids.append(token)
            self._from_draft.append(drafted)
            self.processor.accept([token])
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            n_out = len(self.token_ids) - len(self.prompt_ids)
            if not params.ignore_eos and token in self.tokenizer.eos_token_ids or token in (params.stop_token_ids or ()):
                self.finish("stop")
                self._text_ends.append(len(self.text))
                return
            before = len(self.text)
            self.text += self.detokenizer.add(token)
            self._text_ends.append(len(self.text))
            if self._stop_strings and params.stop_strings_after_token is not None:
                self._mark_stop_span(token, before)
            if n_out == params.min_tokens:
                self._stop_floor = before
            if self._stop_strings and n_out >= params.min_tokens and self._check_stop_strings():
                return
            if self.processor.grammar_finished:  # only the end of the sequence could follow: end it now
                self.finish("stop")
                return
            if n_out >= params.max_tokens or len(self.token_ids) >= self.max_model_len:
                self.finish("length")
                return

    def _mark_stop_span(self, token: int, before: int) -> None:
        """A special token (whose text began at ``before``) closes the open span where stop strings count;
        ``stop_strings_after_token`` opens the next."""
        if token == self.params.stop_strings_after_token or token in self.tokenizer.special_token_ids:
            if self._stop_spans and self._stop_spans[-1][1] is None:
                self._stop_spans[-1][1] = before
        if token == self.params.stop_strings_after_token:
            self._stop_spans.append([len(self.text), None])

    def _find_stop(self, stop: str, start: int, end: int) -> int:
        """The first place in text[start:end] where ``stop`` ends past the floor (min_tokens), or -1."""
        pos = self.text.find(stop, start, end)
        while pos >= 0 and pos + len(stop) <= self._stop_floor:
            pos = self.text.find(stop, pos + 1, end)
        return pos

    def _check_stop_strings(self) -> bool:
        window_start = max(0, self._emitted_chars - self._holdback - 8)
        while self._stop_spans and self._stop_spans[0][1] is not None and self._stop_spans[0][1] <= window_start:
            self._stop_spans.pop(0)  # spans end before the window: searched already
        hits = [(self._find_stop(s, max(start, window_start), len(self.text) if end is None else end), s)
                for start, end in self._stop_spans for s in self._stop_strings]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        self.text = self.text[: pos + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.stop_string = stop
        self.finish("stop", flush=False)
        return True

    def finish(self, reason: str, flush: bool = True) -> None:
        if flush:
            self.text += self.detokenizer.flush()
            if self._text_ends:  # what the detokenizer held back belongs to the last token
                self._text_ends[-1] = len(self.text)
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.metrics.generated_tokens = self.num_output_tokens - self._base_tokens
        self.metrics.total_s = time.perf_counter() - self.arrival_s

    def fail(self, error: str) -> None:
        """End this sequence because processing it raised: it keeps the text delivered so far, nothing after."""
        self.error = error
        self.text = self.text[:self._emitted_chars]
        del self.token_ids[len(self.prompt_ids) + self._emitted_tokens:]
        del self._from_draft[self._emitted_tokens:]
        del self._text_ends[self._emitted_tokens:]
        if self.params.logprobs is not None:
            del self.logprobs[self._emitted_tokens:]
        self.finish("error", flush=False)

    def take_chunk(self) -> StreamChunk | None:
        """New tokens and text since the last call; text that may still become a stop string is held back."""
        n_out = self.num_output_tokens
        limit = len(self.text) if self.finished else max(self._emitted_chars, len(self.text) - self._holdback)
        if n_out == self._emitted_tokens and limit == self._emitted_chars and not self.finished:
            return None
        chunk = StreamChunk(
            request_id=self.request_id, index=self.index,
            text=self.text[self._emitted_chars:limit],
            token_ids=self.token_ids[len(self.prompt_ids) + self._emitted_tokens:],
            from_draft=self._from_draft[self._emitted_tokens:],
            finished=self.finished, finish_reason=self.finish_reason,
            logprobs=self.logprobs[self._emitted_tokens:] if self.params.logprobs is not None else None,
            metrics=self.metrics if self.finished else None, error=self.error,
            stop_string=self.stop_string if self.finished else None,
            spans=self._spans(self._emitted_chars, limit), prompt_logprobs=self._unsent_prompt_logprobs(),
        )
        self._emitted_tokens, self._emitted_chars = n_out, limit
        return chunk

    def prompt_logprobs_out(self) -> list[dict | None] | None:
        """The prompt logprobs as vLLM returns them, one entry per prompt token, None for the first (nothing
        predicts it); None where the request did not ask. A request's first sample (index 0) computes its prompt."""
        return [None] + self.prompt_logprobs if self.params.prompt_logprobs is not None else None

    def _unsent_prompt_logprobs(self) -> list[dict | None] | None:
        """``prompt_logprobs_out`` on the first sample's first chunk, None on every other chunk."""
        if self._prompt_logprobs_sent or self.index != 0:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs_out()

    def _spans(self, start: int, end: int) -> list[tuple[int, bool]]:
        """Characters start..end-1 of the text cut by the token that wrote them: (characters, from an accepted
        draft), one span for each token that ends here (none of its own text, as when the detokenizer waits for
        the next token: an empty span), so the spans of a stream count its tokens. A token held back past the
        chunk (a possible stop string) gives its first characters a span here and the rest one in a later chunk."""
        ends, spans, i, at = self._text_ends, [], self._spanned, start
        while i < len(ends) and ends[i] <= end:
            spans.append((max(0, ends[i] - at), self._from_draft[i]))
            at = max(at, ends[i])
            i += 1
        self._spanned = i
        if at < end:
            spans.append((end - at, self._from_draft[i] if i < len(ends) else False))
        return spans

    def to_output(self) -> CompletionOutput:
        """The generated text and tokens (after a ``resume``, only those generated since)."""
        new_ids = self.output_ids[self._base_tokens:]
        self.metrics.generated_tokens = len(new_ids)
        return CompletionOutput(
            index=self.index, text=self.text[self._base_chars:], token_ids=new_ids, finish_reason=self.finish_reason,
            logprobs=self.logprobs[self._base_tokens:] if self.params.logprobs is not None else None,
            metrics=self.metrics, error=self.error,
        )
