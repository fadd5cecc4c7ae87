"""Fill in the middle: a code model's marks for the text before the cursor (prefix), after it (suffix) and the part
to write (middle), found in its vocabulary, and the prompt llama.cpp's ``/infill`` builds from them.

The prompt, as llama-server builds it (``format_infill``), with the repo-level pattern of the Qwen2.5-Coder report
where the model has its repository and file-separator tokens::

    [REPO]myproject\\n [SEP]filename0\\n text 0 ... [SEP]filename\\n [BOS] [PRE] prefix prompt [SUF] suffix [MID]

A model without them gets each extra file's text after a "--- snippet ---" line. Every text is tokenized as plain
text (``Tokenizer.encode_plain``): a mark spelled in the code stays code. Cut as llama-server cuts: the prefix keeps
its last three quarters of a 2,048-token budget (or of the context, if smaller), the suffix its first quarter less
the prompt's tokens, the extra files the room the context has beyond the budget and twice ``max_tokens`` (their
last tokens).
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
        """The vocabulary's marks (special tokens only: a plain token spelled "<PRE>" is text); None where it lacks
        any of prefix, suffix and middle."""
        found = {}
        for role, texts in ROLE_TEXTS.items():
            ids = [tokenizer.token_to_id(t) for t in texts]
            found[role] = next((i for i in ids if i is not None and tokenizer.is_special(i)), None)
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


def infill_ids(tokenizer: Tokenizer, fim: FimTokens, infill: Infill, context: int, max_tokens: int) -> tuple[
        list[int], bool]:
    """The prompt's token ids and whether anything was cut (see the module's docstring); ``context``: the model's
    context window, ``max_tokens``: the most the fill may write. Tokenizes: call it off an event loop."""
    budget = min(BUDGET, context)
    prefix, suffix = tokenizer.encode_plain(infill.prefix), tokenizer.encode_plain(infill.suffix)
    prompt = tokenizer.encode_plain(infill.prompt) if infill.prompt else []
    extra: list[int] = []
    if fim.repo is not None:
        extra += [fim.repo, *tokenizer.encode_plain("myproject\n")]
    for filename, text in infill.extra:
        extra += ([fim.sep, *tokenizer.encode_plain(filename + "\n")] if fim.sep is not None
                  else tokenizer.encode_plain(SNIPPET))
        extra += tokenizer.encode_plain(text)
    if fim.sep is not None:
        extra += [fim.sep, *tokenizer.encode_plain("filename\n")]
    prefix_take = min(len(prefix), 3 * (budget // 4))
    suffix_take = min(len(suffix), max(0, budget // 4 - (2 + len(prompt))))
    extra_take = min(len(extra), max(0, context - budget - 2 * max_tokens))
    # (the project's header alone does not count: it is cut where the context has no room beyond the budget)
    cut = prefix_take < len(prefix) or suffix_take < len(suffix) or bool(infill.extra) and extra_take < len(extra)
    head = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    ids = (extra[len(extra) - extra_take:] + head + [fim.prefix, *prefix[len(prefix) - prefix_take:], *prompt]
           + [fim.suffix, *suffix[:suffix_take], fim.middle])
    return ids, cut
