"""A prompt's logprobs in the completions API's shapes, each rendered once per prompt however many samples it has:
OpenAI's ``echo`` with ``logprobs`` (the prompt's tokens lead a choice's logprobs, the first with none) and vLLM's
``prompt_logprobs`` field ({token id: {logprob, rank, decoded_token}} per prompt token, None for the first)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from quickdraft.serving.errors import invalid_parameter
from quickdraft.serving.openai_format import TokenText, clean_logprob, completion_logprobs


def vllm_prompt_logprobs(entries: list[dict | None] | None, token_text: TokenText,
                         top: int) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` of the engine's entries (``RequestOutput.prompt_logprobs``): the prompt's token
    and the ``top`` most likely at its position."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tokens = {str(e["token_id"]): {"logprob": clean_logprob(e["logprob"]), "rank": e["rank"],
                                       "decoded_token": token_text(e["token_id"])}}
        for rank, (tid, lp) in enumerate(e["top"][:top], 1):
            tokens.setdefault(str(tid), {"logprob": clean_logprob(lp), "rank": rank, "decoded_token": token_text(tid)})
        out.append(tokens)
    return out


@dataclass
class PromptLogprobs:
    """What a /v1/completions request's choices carry of their prompt's logprobs: ``echo_top`` (OpenAI's echo with
    ``logprobs``: that many top tokens a position) and ``field_top`` (vLLM's field), None where not asked."""

    prompt_ids: Callable[[int], list[int]]  # a prompt's token ids, by its index in the request
    token_text: TokenText
    echo_top: int | None = None
    field_top: int | None = None
    _rendered: dict[int, tuple[dict | None, list | None]] = field(default_factory=dict)

    @property
    def top(self) -> int | None:
        """The top tokens the engine must keep a position (``SamplingParams.prompt_logprobs``): the larger ask."""
        asked = [k for k in (self.echo_top, self.field_top) if k is not None]
        return max(asked) if asked else None

    def rendered(self, prompt_index: int, entries: list[dict | None] | None) -> tuple[dict | None, list | None]:
        """(the echoed prompt's logprobs in OpenAI's shape, vLLM's field) of one prompt, rendered the first time its
        entries are given (a stream's later samples of the prompt give none: they read that rendering). Entries
        missing before then (the request failed before its prompt was scored, or a forked sample's chunk came first)
        give no echoed logprobs, and are not kept: the prompt's own may still come."""
        if prompt_index in self._rendered:
            return self._rendered[prompt_index]
        if entries is None:
            return (completion_logprobs([], 0, self.token_text) if self.echo_top is not None else None), None
        echo = field_ = None
        if self.echo_top is not None:
            echoed = [e if e is not None else {"token_id": tid, "logprob": None, "top": []}
                      for tid, e in zip(self.prompt_ids(prompt_index), entries)]
            echo = completion_logprobs([{**e, "top": e["top"][:self.echo_top]} for e in echoed], 0, self.token_text)
        if self.field_top is not None:
            field_ = vllm_prompt_logprobs(entries, self.token_text, self.field_top)
        self._rendered[prompt_index] = (echo, field_)
        return echo, field_

    def check_size(self, prompt_tokens: int, samples: int, limit: int) -> None:
        """``check_size`` for this request's asks, each of its samples carrying them."""
        check_size(prompt_tokens, [k for k in (self.echo_top, self.field_top) if k is not None], samples, limit,
                   "prompt_logprobs" if self.field_top is not None else "logprobs")


def check_size(prompt_tokens: int, tops: list[int], copies: int, limit: int, param: str = "prompt_logprobs") -> None:
    """Refuse, before any model work, a response that would carry more than ``limit`` prompt logprobs: each prompt
    token's own and its top ones, in each shape asked (``tops``), ``copies`` times (once per sample)."""
    count = prompt_tokens * sum(k + 1 for k in tops) * copies
    if count > limit:
        raise invalid_parameter(
            f"{param}: {prompt_tokens} prompt tokens with {' and '.join(map(str, tops))} top logprobs each, "
            f"{copies} times, make {count} logprobs, more than the {limit} a response of this server may carry; "
            f"ask for fewer top logprobs, samples or prompt tokens", param)

