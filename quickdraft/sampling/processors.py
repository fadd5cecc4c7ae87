"""Per-sequence logits processing shared by plain sampling and both sides of speculative sampling.

Exact speculative sampling needs the target distribution ``p`` used at drafted
position ``i`` to be exactly the distribution plain sampling would have used
there, i.e. conditioned on the committed output *plus the drafted tokens before
position i*. :class:`LogitsProcessor` does that: row ``i`` of ``process`` sees
``committed outputs + drafted[:offset + i]``.

Order of transforms (as vLLM): the grammar's mask (structured outputs) and ``allowed_token_ids``, the ends of the
sequence masked before ``min_tokens`` (where anything else is allowed), logit_bias, repetition penalty (prompt +
output tokens), frequency and presence penalties (output tokens only; with ``repeat_last_n`` all three llama.cpp's,
over a window of both: ``penalties.py``), DRY (``dry.py``), then for temperature > 0:
the temperature and the samplers that keep part of the vocabulary (``truncation.py``), or mirostat in their place
(``mirostat.py``: its state follows the committed tokens and the target's rows they were drawn from, see ``probs``).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quickdraft.sampling.bad_words import bad_word_ids, banned_next
from quickdraft.sampling.dry import SequenceBreakers, dry_penalties, sequence_breakers
from quickdraft.sampling.grammar import GrammarState
from quickdraft.sampling.mirostat import Mirostat
from quickdraft.sampling.params import SamplingParams
from quickdraft.sampling.penalties import Penalties
from quickdraft.sampling.sampler import to_device
from quickdraft.sampling.truncation import truncate
from quickdraft.tokenizer import Tokenizer

# Below this temperature the logits are shifted by their row max before the division, so a large logit over a
# small temperature cannot overflow to inf (softmax is shift invariant). SamplingParams bounds the temperature.
_SMALL_TEMPERATURE = 1e-3


def _check_rows(n: int, drafted: Sequence[int], offset: int) -> None:
    """Row i of n sees drafted[:offset + i]: the transforms that read the history need that many drafted tokens."""
    if offset < 0 or offset + n - 1 > len(drafted):
        raise ValueError(f"{n} logits rows from offset={offset} need at least {offset + n - 1} drafted tokens, "
                         f"got {len(drafted)}")


def _unless_emptied(masked: Tensor, x: Tensor) -> Tensor:
    """``masked``, but a row it left without a finite logit is x's: an empty distribution cannot be sampled."""
    return torch.where(torch.isfinite(masked).any(dim=1, keepdim=True), masked, x)


def _ids(tokens: Sequence[int] | Tensor) -> list[int]:
    if isinstance(tokens, Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


class LogitsProcessor:
    """Applies one sequence's sampling parameters to its logits.

    ``vocab_size`` is the number of ids the tokenizer knows. Logits may be wider (checkpoints pad their
    embedding rows, e.g. to a multiple of 64): those columns are masked out of every distribution, so a padding
    row is never sampled, drafted or verified. Token ids beyond the logits width are ignored. ``eos_ids``: the
    tokenizer's end-of-sequence ids, which ``min_tokens`` holds back (with ``stop_token_ids``) unless ``ignore_eos``.
    ``breakers``: DRY's sequence breakers in this vocabulary (``dry.sequence_breakers``; none if not given);
    ``bad_words``: the token sequences of ``params.bad_words`` (``vocabulary_inputs`` gives both).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] | Tensor,
        vocab_size: int,
        device: str | torch.device = "cpu",
        grammar: GrammarState | None = None,
        eos_ids: Sequence[int] = (),
        breakers: SequenceBreakers | None = None,
        bad_words: Sequence[tuple[int, ...]] = (),
    ) -> None:
        self.params = params
        self.grammar = grammar  # the request's structured-output constraint, followed token by token
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._prompt_ids = _ids(prompt_ids)
        self._output_ids: list[int] = []
        self._penalties = Penalties(params, self._prompt_ids) if params.has_penalties else None
        self._use_bias = bool(params.logit_bias)
        self._breakers = (breakers or SequenceBreakers.none()) if params.uses_dry else None
        self._context: np.ndarray | None = None  # prompt + committed output, for DRY (built when first needed)
        self._allowed: tuple[int, Tensor] | None = None  # (width, the allowed_token_ids mask) on the logits' device
        self._bad_words = tuple(bad_words)
        # the ids no row may pick while the output is shorter than min_tokens (vLLM's min_tokens)
        ends = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else {int(t) for t in eos_ids})
        self._held_ends = sorted(ends) if params.min_tokens > 0 else []
        self._held: tuple[int, Tensor] | None = None  # (width, the held ids below it) on the logits' device
        self._bias: tuple[int, Tensor, Tensor] | None = None
        self._mirostat = Mirostat(params, vocab_size) if params.mirostat and not params.greedy else None

    # ---------------------------------------------------------------- history
    @property
    def output_ids(self) -> list[int]:
        """The committed generated tokens (a copy)."""
        return list(self._output_ids)

    @property
    def greedy_on_raw_logits(self) -> bool:
        """Greedy with nothing that changes the logits (no grammar, bias or penalty): the choice is the argmax of
        the rows as the model gave them (the runner masks padding columns), so a batch's choices can be taken in one
        call on the device."""
        return (self.params.greedy and self.grammar is None and self._breakers is None
                and self.params.allowed_token_ids is None and not self._bad_words
                and not (self._use_bias or self._penalties is not None or self._holds_ends(0)))

    def _holds_ends(self, first: int) -> int:
        """How many rows from output position len(output) + first on have the ends of the sequence masked."""
        return max(0, self.params.min_tokens - len(self._output_ids) - first) if self._held_ends else 0

    @property
    def grammar_finished(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return self.grammar is not None and self.grammar.finished

    def legal_drafts(self, drafted: Sequence[int]) -> int:
        """How many leading drafted tokens the grammar allows (all without a grammar)."""
        return len(drafted) if self.grammar is None else self.grammar.legal_prefix(drafted)

    def forced_tokens(self, drafted: Sequence[int], limit: int) -> list[int]:
        """Tokens the grammar forces after ``drafted`` (none without a grammar), at most ``limit``."""
        return [] if self.grammar is None else self.grammar.forced(drafted, limit)

    def accept(self, token_ids: Sequence[int] | Tensor) -> None:
        """Commit generated tokens (after verification) to the output history."""
        ids = _ids(token_ids)
        if not ids:
            return
        if self.grammar is not None:
            self.grammar.accept(ids)
        if self._mirostat is not None:
            self._mirostat.accept(ids)
        self._output_ids.extend(ids)
        if self._context is not None:
            self._context = np.concatenate((self._context, np.asarray(ids, dtype=np.int64)))
        if self._penalties is not None:
            self._penalties.accept(ids)

    @property
    def mirostat(self) -> Mirostat | None:
        """The request's mirostat state (None without it): its ``mu`` is what resuming the output needs beside its
        tokens."""
        return self._mirostat

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"output_ids": list(self._output_ids)}
        if self._mirostat is not None:
            state["mirostat_mu"] = self._mirostat.mu
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The committed output (and mirostat's mu, where the state has it) of ``state_dict``."""
        self._output_ids = _ids(state["output_ids"])
        if self._mirostat is not None:
            self._mirostat.restart(state.get("mirostat_mu"))
        self._context = None  # rebuilt lazily from the history
        if self._penalties is not None:
            self._penalties.restart(self._output_ids)
        if self.grammar is not None:
            self.grammar.reset()
            self.grammar.accept(self._output_ids)

    def fork(self) -> "LogitsProcessor":
        """An independent copy (same params, prompt and history), e.g. for n > 1."""
        other = copy.copy(self)
        other._output_ids = list(self._output_ids)
        other.grammar = None if self.grammar is None else self.grammar.fork()
        other._mirostat = None if self._mirostat is None else self._mirostat.fork()
        other._penalties = None if self._penalties is None else self._penalties.fork()
        return other

    # ------------------------------------------------------------------ caches
    def _bias_tensors(self, device: torch.device, width: int) -> tuple[Tensor, Tensor]:
        """The bias's ids below ``width`` (the logits' width: ids beyond it are ignored) and its values."""
        if self._bias is None or self._bias[0] != width or self._bias[1].device != device:
            items = sorted((k, v) for k, v in (self.params.logit_bias or {}).items() if k < width)
            idx = to_device(torch.tensor([k for k, _ in items], dtype=torch.long), device)
            val = to_device(torch.tensor([v for _, v in items], dtype=torch.float32), device)
            self._bias = (width, idx, val)
        return self._bias[1], self._bias[2]

    # -------------------------------------------------------------- transform
    def process(
        self, logits: Tensor, drafted: Sequence[int] | Tensor = (), offset: int = 0, *, start: int | None = None,
        draft: bool = False,
    ) -> Tensor:
        """Transform ``logits`` [n, V] (or [V]) into float32 processed logits of the same shape.

        Row ``i`` is conditioned on ``committed outputs + drafted[:offset + i]``: the
        target verifying k drafts passes ``k + 1`` rows with ``drafted=drafts``; a
        drafter producing draft ``j`` from one row passes ``drafted=drafts[:j], offset=j``.
        ``start`` is an alias of ``offset``. ``draft``: the rows a drafter draws from, where mirostat keeps what it
        keeps at its first mu (``mirostat.py``).
        For greedy params the result stops after bias and penalties (take the argmax).
        The input tensor is never modified; the result may be the input itself when
        nothing applies (greedy, float32, no bias/penalties).
        """
        squeeze = logits.dim() == 1
        x = logits.unsqueeze(0) if squeeze else logits
        if x.dim() != 2:
            raise ValueError(f"logits must be [n, V] or [V], got shape {tuple(logits.shape)}")
        x = x.float()
        n, width = x.shape
        p = self.params
        # on the CPU, skip the copy where the runner already masked them; elsewhere that check would wait for the device
        if width > self.vocab_size and (x.device.type != "cpu" or not bool(torch.isneginf(x[:, self.vocab_size:]).all())):
            if x.data_ptr() == logits.data_ptr():  # float() made no copy: the caller's logits stay as they are
                x = x.clone()
            x[:, self.vocab_size:] = float("-inf")
        if self.grammar is not None:
            allowed = self.grammar.allowed(_ids(drafted), offset if start is None else start, n, width)
            x = x.masked_fill(~to_device(allowed, x.device), float("-inf"))
        if p.allowed_token_ids is not None:
            x = self._mask_allowed(x, width)
        if self._bad_words:
            x = self._mask_bad_words(x, _ids(drafted), offset if start is None else start)
        held = min(n, self._holds_ends(offset if start is None else start))
        if held:
            x = self._mask_ends(x, held, width)

        if self._use_bias:
            idx, val = self._bias_tensors(x.device, width)
            x = x.index_add(1, idx, val.unsqueeze(0).expand(n, -1))
        if self._penalties is not None:
            first = offset if start is None else start
            _check_rows(n, _ids(drafted), first)
            x = self._penalties.apply(x, _ids(drafted), first)
        if self._breakers is not None:
            x = self._apply_dry(x, _ids(drafted), offset if start is None else start)

        if p.greedy:
            return x.squeeze(0) if squeeze else x

        if p.temperature_last and p.has_truncation:  # (llama-server's default chain)
            x = truncate(x, p, lambda cut: self._apply_temperature(cut, p.temperature))
            return x.squeeze(0) if squeeze else x
        x = self._apply_temperature(x, p.temperature)
        if self._mirostat is not None:
            first = offset if start is None else start
            _check_rows(n, _ids(drafted), first)
            x = self._mirostat.draft_rows(x) if draft else self._mirostat.rows(x, _ids(drafted), first)
        elif p.has_truncation:
            x = truncate(x, p)
        return x.squeeze(0) if squeeze else x

    def _mask_ends(self, x: Tensor, rows: int, width: int) -> Tensor:
        """The first ``rows`` rows of x with the held ends at -inf (a new tensor: x may be the caller's logits)."""
        if self._held is None or self._held[0] != width or self._held[1].device != x.device:
            ids = torch.tensor([t for t in self._held_ends if t < width], dtype=torch.long)
            self._held = (width, to_device(ids, x.device))
        ids = self._held[1]
        if not ids.numel():
            return x
        # a row that allows nothing else (a grammar's end) keeps its ends: an empty distribution cannot be sampled
        masked = _unless_emptied(x[:rows].index_fill(1, ids, float("-inf")), x[:rows])
        return masked if rows == x.shape[0] else torch.cat([masked, x[rows:]])

    def _mask_allowed(self, x: Tensor, width: int) -> Tensor:
        """x with every id outside allowed_token_ids at -inf (SamplingParams refuses them beside a grammar; a row
        whose allowed ids all hold -inf keeps what it had, so no row is ever empty)."""
        if self._allowed is None or self._allowed[0] != width or self._allowed[1].device != x.device:
            keep = torch.zeros(width, dtype=torch.bool)
            ids = torch.tensor(self.params.allowed_token_ids or [], dtype=torch.long)
            keep[ids[ids < width]] = True
            self._allowed = (width, to_device(keep, x.device))
        return _unless_emptied(x.masked_fill(~self._allowed[1], float("-inf")), x)

    def _mask_bad_words(self, x: Tensor, drafted: list[int], offset: int) -> Tensor:
        """x with the token that would complete a bad word at -inf, row i after drafted[:offset + i]; a row left
        with nothing else (a grammar that allows only such a token) keeps what it had."""
        _check_rows(x.shape[0], drafted, offset)
        back = max(len(s) for s in self._bad_words) - 1
        rows, cols = [], []
        for i in range(x.shape[0]):
            recent = self._output_ids[max(0, len(self._output_ids) - back):] + drafted[:offset + i]
            for token in banned_next(recent, self._bad_words):
                if token < x.shape[1]:
                    rows.append(i)
                    cols.append(token)
        if not rows:
            return x
        index = tuple(to_device(torch.tensor(t, dtype=torch.long), x.device) for t in (rows, cols))
        return _unless_emptied(x.index_put(index, torch.tensor(float("-inf"), device=x.device)), x)

    def _apply_dry(self, x: Tensor, drafted: list[int], offset: int) -> Tensor:
        """x less DRY's penalties, row i after the context and drafted[:offset + i] (computed on the host)."""
        n, width = x.shape
        _check_rows(n, drafted, offset)
        if self._context is None:
            self._context = np.asarray(self._prompt_ids + self._output_ids, dtype=np.int64)
        rows, cols, values = [], [], []
        for i in range(n):
            extra = drafted[:offset + i]
            context = np.concatenate((self._context, np.asarray(extra, dtype=np.int64))) if extra else self._context
            ids, penalties = dry_penalties(context, self.params, self._breakers)
            inside = ids < width
            rows.append(np.full(int(inside.sum()), i))
            cols.append(ids[inside])
            values.append(penalties[inside])
        if not sum(len(c) for c in cols):
            return x
        index = (torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(cols)))
        delta = torch.from_numpy(-np.concatenate(values)).to(torch.float32)
        return x.index_put(tuple(to_device(t, x.device) for t in index), to_device(delta, x.device), accumulate=True)

    def probs(
        self, logits: Tensor, drafted: Sequence[int] | Tensor = (), offset: int = 0, *, start: int | None = None
    ) -> Tensor:
        """softmax(process(...)); for greedy params a one-hot of the argmax.

        The target's distribution, row i after drafted[:i] (a drafter calls ``process``): under mirostat its rows
        are kept until the tokens drawn from them are committed (``accept``), which advance mu from them."""
        x = self.process(logits, drafted, offset, start=start)
        if self.params.greedy:
            out = torch.zeros_like(x)
            return out.scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        if self._mirostat is not None and (offset if start is None else start) == 0:
            self._mirostat.drawn_from(x if x.dim() == 2 else x.unsqueeze(0), _ids(drafted))
        return torch.softmax(x, dim=-1)

    @staticmethod
    def _apply_temperature(x: Tensor, t: float) -> Tensor:
        if t == 1.0:
            return x
        if t < _SMALL_TEMPERATURE:
            # Shift first so huge ratios cannot overflow to inf (softmax is shift invariant).
            return (x - x.amax(dim=-1, keepdim=True)) / t
        return x / t


def vocabulary_inputs(tokenizer: Tokenizer, params: SamplingParams) -> dict[str, Any]:
    """What a request's LogitsProcessor needs from its vocabulary: DRY's sequence breakers and the bad words' token
    sequences (keyword arguments of LogitsProcessor)."""
    return {"breakers": sequence_breakers(tokenizer, params.dry_sequence_breakers) if params.uses_dry else None,
            "bad_words": bad_word_ids(tokenizer, params.bad_words) if params.bad_words else ()}
