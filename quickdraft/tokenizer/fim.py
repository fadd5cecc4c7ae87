"""Fill in the middle: a code model's marks for the text before the cursor (prefix), after it (suffix) and the part
to write (middle), found in its vocabulary, and the prompt llama.cpp's ``/infill`` builds from them.

The prompt, as llama-server builds it (``format_infill``), with the repo-level pattern of the Qwen2.5-Coder report
where the model has its repository and file-separator tokens::

    [REPO]myproject\\n [SEP]filename0\\n text 0 ... [SEP]filename\\n [BOS] [PRE] prefix prompt [SUF] suffix [MID]

A model without them gets each extra file's text after a "--- snippet ---" line. The code is tokenized as plain
text (``Tokenizer.encode_plain``): a mark spelled in it stays code; ``prompt`` as llama-server reads it, special
tokens' spellings as the tokens. Cut as llama-server cuts, within what the context holds: the prefix keeps its last
three quarters of a 2,048-token budget, the suffix its first quarter less the prompt's tokens and 2, the extra files
(their last tokens) what is left; the budget and the extra files fit beside the fill's room (``max_tokens``, or a
quarter of the context up to 512 without it), so a cut prompt is never refused for its length. llama-server sizes
the extra files by its context less the budget and twice its own ``n_predict`` and lets a longer prompt shift its
context.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quickdraft.tokenizer.tokenizer import Tokenizer

BUDGET = 2048  # llama-server's default batch, by which it sizes the prefix and the suffix
# each role's spellings in the vocabularies llama.cpp knows (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, CodeLlama)
ROLE_TEXTS = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>", "<REPO>"),
    "sep": ("<|file_sep|>", "<file_sep>"),
}
SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of extra files where the model has no file token


@dataclass(frozen=True)
class FimTokens:
    """The special tokens of one vocabulary's fill-in-the-middle roles."""

    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FimTokens | None:
        """The vocabulary's marks: special or added tokens (a tokenizer.json may leave them unmarked; llama.cpp
        makes them control tokens), never a merged token that happens to spell "<PRE>". None where it lacks any of
        prefix, suffix and middle."""
        added = set(tokenizer.backend.get_added_tokens_decoder())
        found = {}
        for role, texts in ROLE_TEXTS.items():
            ids = [tokenizer.token_to_id(t) for t in texts]
            found[role] = next((i for i in ids if i is not None and (tokenizer.is_special(i) or i in added)), None)
        if None in (found["prefix"], found["suffix"], found["middle"]):
            return None
        return cls(**found)

    @property
    def ends(self) -> tuple[int, ...]:
        """The marks that end a fill beside the end of the sequence (llama.cpp counts them end of generation)."""
        return tuple(t for t in (self.pad, self.repo, self.sep) if t is not None)


def describe_missing() -> str:
    return (f"this model's vocabulary has no fill-in-the-middle tokens ({', '.join(ROLE_TEXTS['prefix'][:3])} ...): "
            f"infilling needs a model trained for it, such as Qwen2.5-Coder")


@dataclass
class Infill:
    """What to fill: the text before and after the cursor, text typed after the prefix (llama-server's ``prompt``),
    and other files of the project as (filename, text)."""

    prefix: str
    suffix: str
    prompt: str = ""
    extra: Sequence[tuple[str, str]] = ()


def infill_ids(tokenizer: Tokenizer, fim: FimTokens, infill: Infill, context: int, max_tokens: int | None) -> tuple[
        list[int], bool]:
    """The prompt's token ids and whether anything was cut (see the module's docstring); ``context``: the model's
    context window, ``max_tokens``: the most the fill may write (None: as much as fits). Tokenizes: call it off an
    event loop."""
    head = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    fill = max_tokens if max_tokens else min(BUDGET // 4, context // 4)
    room = max(0, context - fill - 1 - len(head))  # the budget's prompt is at most budget + 1 tokens long
    budget = min(BUDGET, room)
    prefix, suffix = tokenizer.encode_plain(infill.prefix), tokenizer.encode_plain(infill.suffix)
    prompt = tokenizer.encode(infill.prompt, add_special_tokens=False) if infill.prompt else []
    extra: list[int] = []
    if fim.repo is not None:
        extra += [fim.repo, *tokenizer.encode_plain("myproject\n")]
    for filename, text in infill.extra:
        extra += ([fim.sep, *tokenizer.encode_plain(filename + "\n")] if fim.sep is not None
                  else tokenizer.encode_plain(SNIPPET))
        extra += tokenizer.encode_plain(text)
    if fim.sep is not None:
        extra += [fim.sep, *tokenizer.encode_plain("filename\n")]
    typed = len(prompt)
    prompt = prompt[:max(0, budget - 3)]  # (a prompt longer than the budget is cut too)
    prefix_take = min(len(prefix), 3 * (budget // 4), max(0, budget - 3 - len(prompt)))
    suffix_take = min(len(suffix), max(0, budget // 4 - (2 + len(prompt))))
    extra_take = min(len(extra), room - budget)
    # (the project's header alone does not count: it is cut where the context has no room beyond the budget)
    cut = (prefix_take < len(prefix) or suffix_take < len(suffix) or len(prompt) < typed
           or bool(infill.extra) and extra_take < len(extra))
    ids = (extra[len(extra) - extra_take:] + head + [fim.prefix, *prefix[len(prefix) - prefix_take:], *prompt]
           + [fim.suffix, *suffix[:suffix_take], fim.middle])
    return ids, cut
