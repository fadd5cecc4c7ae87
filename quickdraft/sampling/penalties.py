"""The repetition, frequency and presence penalties (vLLM's): the repetition penalty divides (or multiplies) the logit
of every id of the prompt and the output; the frequency penalty subtracts in proportion to an id's count in the
output, the presence penalty once for an id the output holds.

They touch only the columns of the ids the history holds, never a whole 150k-wide row: ``Penalties`` keeps those
ids sorted and distinct, whether each is in the prompt and its output count, built when first needed and updated
as tokens are committed. Row i of a verification also counts the drafts before it.

With ``repeat_last_n`` set, they are llama.cpp's instead: all three count the last ``repeat_last_n`` tokens of the
prompt and the output together (-1: all of them), row i's window ending with the drafts before it.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor

from quickdraft.sampling.params import SamplingParams
from quickdraft.sampling.sampler import to_device


def _merge(cols: Tensor, in_prompt: Tensor, counts: Tensor, new: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Add ids ``new`` to the sorted distinct ``cols``; returns new tensors and the positions of ``new``."""
    merged, inv = torch.unique(torch.cat([cols, new]), sorted=True, return_inverse=True)
    m = cols.numel()
    if merged.numel() == m:  # nothing new: keep the tensors
        return cols, in_prompt, counts, inv[m:]
    in_prompt2 = torch.zeros(merged.numel(), dtype=torch.bool, device=cols.device)
    in_prompt2[inv[:m]] = in_prompt
    counts2 = torch.zeros(merged.numel(), dtype=counts.dtype, device=cols.device)
    counts2[inv[:m]] = counts
    return merged, in_prompt2, counts2, inv[m:]


def _per_row(counts: Tensor, pos: Tensor, offset: int, rows: int) -> Tensor:
    """``counts`` [m] for each of ``rows`` rows [rows, m], row i also counting the drafts before it
    (drafted[:offset + i], at columns ``pos``)."""
    drafts = pos.numel()
    seen = torch.arange(drafts).unsqueeze(0) < (offset + torch.arange(rows)).unsqueeze(1)  # [rows, D]
    row_idx = torch.arange(rows).unsqueeze(1).expand(rows, drafts)[seen]
    matrix = counts.unsqueeze(0).repeat(rows, 1)
    matrix.index_put_((row_idx, pos.unsqueeze(0).expand(rows, drafts)[seen]), torch.ones(row_idx.numel()),
                      accumulate=True)
    return matrix


class Penalties:
    """One output's penalties over its prompt and committed tokens. The history's tensors live on the host (its
    bookkeeping reads ids) and are never changed in place, so a fork shares them."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.params = params
        self._prompt_ids = prompt_ids
        self._output_ids: list[int] = []
        self._hist: tuple[Tensor, Tensor, Tensor] | None = None  # (cols, in_prompt, counts)
        self._all: tuple[Tensor, Tensor] | None = None  # (cols, counts) of prompt and output, for repeat_last_n -1

    def fork(self) -> "Penalties":
        other = copy.copy(self)
        other._output_ids = list(self._output_ids)
        return other

    def restart(self, output_ids: list[int]) -> None:
        """Count ``output_ids`` as the whole committed output."""
        self._output_ids, self._hist, self._all = list(output_ids), None, None

    def accept(self, ids: list[int]) -> None:
        self._output_ids.extend(ids)
        if self._all is not None:
            cols, counts = self._all
            cols, _, counts, pos = _merge(cols, torch.zeros(cols.numel(), dtype=torch.bool), counts,
                                          torch.tensor(ids, dtype=torch.long))
            self._all = (cols, counts.index_add(0, pos, torch.ones(len(ids))))
        if self._hist is not None:
            cols, in_prompt, counts = self._hist
            cols, in_prompt, counts, pos = _merge(cols, in_prompt, counts, torch.tensor(ids, dtype=torch.long))
            self._hist = (cols, in_prompt, counts.index_add(0, pos, torch.ones(len(ids))))

    def _history(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._hist is None:
            prompt = torch.tensor(self._prompt_ids, dtype=torch.long)
            out = torch.tensor(self._output_ids, dtype=torch.long)
            cols, inv = torch.unique(torch.cat([prompt, out]), sorted=True, return_inverse=True)
            in_prompt = torch.zeros(cols.numel(), dtype=torch.bool)
            in_prompt[inv[: prompt.numel()]] = True
            counts = torch.zeros(cols.numel(), dtype=torch.float32)
            counts.index_add_(0, inv[prompt.numel():], torch.ones(out.numel()))
            self._hist = (cols, in_prompt, counts)
        return self._hist

    def apply(self, x: Tensor, drafted: Sequence[int], offset: int) -> Tensor:
        """``x`` [n, V] penalized, row i after the committed output and drafted[:offset + i] (the caller checked
        there are enough). Only the rows' columns and counts go to x's device, so nothing here waits for it."""
        n = x.shape[0]
        extra = list(drafted[: offset + n - 1])
        if self.params.repeat_last_n is not None:  # llama.cpp's: counts over each row's window of prompt and output
            if self.params.repeat_last_n == 0:
                return x
            cols, counts = self._window_counts(extra, offset, n)
            return self._penalize(x, cols, counts, counts > 0)
        cols, in_prompt, counts = self._history()
        if extra:
            cols, in_prompt, counts, pos = _merge(cols, in_prompt, counts, torch.tensor(extra, dtype=torch.long))
            counts = _per_row(counts, pos, offset, n)
        else:
            counts = counts.unsqueeze(0).expand(n, -1)
        return self._penalize(x, cols, counts, (counts > 0) | in_prompt.unsqueeze(0))

    def _penalize(self, x: Tensor, cols: Tensor, counts: Tensor, repeated: Tensor) -> Tensor:
        """``x`` with the penalties on columns ``cols`` (sorted): ``counts`` [n, m] for the frequency and presence
        penalties, the repetition penalty where ``repeated`` [n, m]; one gather and one scatter."""
        p, width = self.params, x.shape[1]
        if cols.numel() and int(cols[-1]) >= width:  # ids beyond the logits width are ignored
            m = int(torch.searchsorted(cols, width))
            cols, counts, repeated = cols[:m], counts[:, :m], repeated[:, :m]
        if cols.numel() == 0:
            return x
        cols, counts, repeated = (to_device(t.contiguous(), x.device) for t in (cols, counts, repeated))
        block = x.index_select(1, cols)  # [n, m]
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            block = torch.where(repeated, torch.where(block > 0, block / r, block * r), block)
        if p.frequency_penalty != 0.0:
            block = block - p.frequency_penalty * counts
        if p.presence_penalty != 0.0:
            block = block - p.presence_penalty * (counts > 0).to(block.dtype)
        return x.index_copy(1, cols, block)

    def _window_counts(self, extra: list[int], offset: int, rows: int) -> tuple[Tensor, Tensor]:
        """The sorted distinct ids of the rows' windows and each row's counts of them [rows, m], on the host: a
        window of the whole context from counts kept as tokens are committed, a shorter one from the context's last
        tokens alone (never a copy of the whole context a row)."""
        last, total = self.params.repeat_last_n, len(self._prompt_ids) + len(self._output_ids)
        drafts = torch.tensor(extra, dtype=torch.long)
        if last < 0 or last >= total + len(extra):
            cols, counts = self._context_counts()
            cols, _, counts, pos = _merge(cols, torch.zeros(cols.numel(), dtype=torch.bool), counts, drafts)
            return cols, _per_row(counts, pos, offset, rows)
        outputs = self._output_ids[-last:]
        before = self._prompt_ids[len(self._prompt_ids) - (last - len(outputs)):] if last > len(outputs) else []
        tail = torch.tensor(before + outputs, dtype=torch.long)
        sequence = torch.cat([tail, drafts])
        cols = torch.unique(sequence)
        ends = [len(tail) + offset + i for i in range(rows)]  # row i's window ends after drafted[:offset + i]
        matrix = torch.stack([torch.bincount(torch.searchsorted(cols, sequence[max(0, end - last):end]),
                                             minlength=cols.numel()) for end in ends])
        return cols, matrix.float()

    def _context_counts(self) -> tuple[Tensor, Tensor]:
        """(sorted distinct ids, counts) of prompt and output together, kept up to date by ``accept``."""
        if self._all is None:
            cols, counts = torch.unique(torch.tensor(self._prompt_ids + self._output_ids, dtype=torch.long),
                                        return_counts=True)
            self._all = (cols, counts.float())
        return self._all
