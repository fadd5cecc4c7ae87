"""A SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``) as a HF `tokenizers` BPE model.

llama.cpp tokenizes such a vocabulary (Gemma, Llama 2, Mistral v0.1-0.3, Phi-3, ...) like this
(`llm_tokenizer_spm_session` in llama-vocab.cpp):

1. CONTROL, USER_DEFINED and UNKNOWN tokens are cut out of the text whole (`<start_of_turn>`, `<s>`,
   Gemma's runs of spaces and newlines, ...);
2. each remaining piece gets ' ' replaced by '▁' (U+2581) and, when `tokenizer.ggml.add_space_prefix`
   is true (llama.cpp's default for SPM), a leading '▁';
3. the piece is cut into characters and adjacent symbols are merged greedily: always the pair whose
   concatenation is a vocabulary token with the highest score, the leftmost among equals;
4. a character with no token of its own comes out as its UTF-8 bytes, the `<0xXX>` tokens.

Step 3 is BPE with merges ranked by the merged token's score. `spm_merges` derives those merges from
the vocabulary (every split t = a + b with a and b both tokens, ranked by t's score, as transformers'
SentencePieceExtractor does), and a `tokenizers` BPE model with `byte_fallback=True` does steps 3-4.
The normaliser does step 2 and the added tokens step 1.

This module takes plain lists (no metadata dict), so `gguf_vocab` stays the one reader of GGUF fields.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from quickdraft.errors import ModelLoadError

SPACE = "\u2581"  # '▁', SentencePiece's visible space

# llama.cpp's token types, as in gguf_vocab (repeated here: gguf_vocab imports this module)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Phi-3: llama.cpp strips the whitespace after every special token except these (llama-vocab.cpp, "phi-3")
_PHI3_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


# Tokens llama.cpp makes CONTROL whatever type the file gives them (llama_vocab::impl::load), so that they
# are matched whole: the end-of-generation texts always; each fill-in-the-middle text (and DeepSeek's end of
# sentence) only when the file declares no id for that role.
_ALWAYS_CONTROL = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>")
_CONTROL_UNLESS_DECLARED = {
    ("eot",): ("<｜end▁of▁sentence｜>",),
    ("fim_pre", "prefix"): ("<|fim_prefix|>", "<fim-prefix>", "<｜fim▁begin｜>", "<PRE>"),
    ("fim_suf", "suffix"): ("<|fim_suffix|>", "<fim-suffix>", "<｜fim▁hole｜>", "<SUF>"),
    ("fim_mid", "middle"): ("<|fim_middle|>", "<fim-middle>", "<｜fim▁end｜>", "<MID>"),
    ("fim_pad",): ("<|fim_pad|>", "<fim-pad>", "<PAD>"),
    ("fim_rep",): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>"),
    ("fim_sep",): ("<|file_sep|>",),
}
# every text llama.cpp reads as a control token, whatever the file says
CONTROL_LOOKING = _ALWAYS_CONTROL + tuple(t for names in _CONTROL_UNLESS_DECLARED.values() for t in names)


def llama_cpp_token_types(tokens: Sequence[str], token_types: Sequence[int], declared: set[str]) -> list[int]:
    """The token types as llama.cpp uses them: the control-looking tokens above made CONTROL.

    `declared`: the roles whose `tokenizer.ggml.<role>_token_id` the file sets (e.g. {"eot", "fim_pre"})."""
    texts = set(_ALWAYS_CONTROL)
    for roles, names in _CONTROL_UNLESS_DECLARED.items():
        if not declared.intersection(roles):
            texts.update(names)
    out = list(token_types)
    for index, token in enumerate(tokens):
        if token in texts:
            out[index] = _CONTROL
    return out


def check_scores(scores: object, n_tokens: int) -> list[float]:
    """The per-token scores of a SentencePiece vocabulary, checked (they rank the merges)."""
    if scores is None:
        raise ModelLoadError(
            "GGUF SentencePiece tokenizer (tokenizer.ggml.model='llama') has no tokenizer.ggml.scores: "
            "its merges are ranked by those scores, so it cannot be rebuilt without them"
        )
    if not isinstance(scores, (list, tuple)) or len(scores) != n_tokens:
        got = len(scores) if isinstance(scores, (list, tuple)) else type(scores).__name__
        raise ModelLoadError(
            f"GGUF field tokenizer.ggml.scores has {got} entries but tokenizer.ggml.tokens has {n_tokens}"
        )
    try:
        out = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise ModelLoadError("GGUF field tokenizer.ggml.scores must be a list of numbers") from None
    if not all(math.isfinite(s) for s in out):
        raise ModelLoadError("GGUF field tokenizer.ggml.scores holds a NaN or infinite score")
    return out


def spm_vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    """Token text -> id. A text spelled twice maps to its last id, as llama.cpp's token_to_id does;
    empty entries (llama.cpp renames them "[EMPTY_i]") are left out."""
    return {t: i for i, t in enumerate(tokens) if t}


# Characters in one SentencePiece token, far above real vocabularies (Gemma's longest has 31): deriving the merges
# tries every split of every token, so a damaged file's megabyte-long token would take hours to load.
MAX_TOKEN_CHARS = 1024


def spm_merges(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges equivalent to llama.cpp's SPM bigram merging, best first.

    For every token t (any type: llama.cpp's merge step looks the pair up among all tokens) and every
    split t = a + b with a and b tokens, a merge (a, b) ranked by t's score, highest first; equal
    scores keep the lower id first (a stable sort)."""
    order = sorted(vocab, key=lambda t: -scores[vocab[t]])
    return [(a, b) for t in order for k in range(1, len(t)) if (a := t[:k]) in vocab and (b := t[k:]) in vocab]


@lru_cache(maxsize=2)
def _bpe_model(tokens: tuple[str, ...], scores: tuple[float, ...], unk_token: str | None) -> BPE:
    """The BPE model of one vocabulary, kept for the next build of the same vocabulary (a draft model sharing the
    target's tokenizer, a reload): deriving the merges of a large vocabulary is the slow part of loading its
    tokenizer. `tokenizers` models are immutable here and safe to share."""
    vocab = spm_vocab_dict(tokens)
    return BPE(vocab=vocab, merges=spm_merges(vocab, scores), dropout=None, unk_token=unk_token, fuse_unk=False,
               byte_fallback=True, ignore_merges=False)


def _added_tokens(tokens: Sequence[str], token_types: Sequence[int],
                  rstrip_specials: bool) -> tuple[list[AddedToken], list[AddedToken], set[int]]:
    """CONTROL and UNKNOWN tokens as special added tokens, USER_DEFINED ones as plain added tokens:
    llama.cpp's special-token cache, matched in the raw text before any normalisation."""
    special: list[AddedToken] = []
    plain: list[AddedToken] = []
    special_ids: set[int] = set()
    for index, (token, ttype) in enumerate(zip(tokens, token_types)):
        if not token or ttype not in (_CONTROL, _USER_DEFINED, _UNKNOWN):
            continue
        rstrip = rstrip_specials and token not in _PHI3_NO_RSTRIP
        added = AddedToken(token, single_word=False, lstrip=False, rstrip=rstrip, normalized=False,
                           special=ttype != _USER_DEFINED)
        if ttype == _USER_DEFINED:
            plain.append(added)
        else:
            special.append(added)
            special_ids.add(index)
    return special, plain, special_ids


def is_phi3(model_name: object) -> bool:
    """llama.cpp recognises Phi-3 by its general.name and gives its special tokens RSTRIP."""
    return isinstance(model_name, str) and any(k in model_name.lower() for k in ("phi-3", "phi3"))


def build_spm_backend(tokens: list[str], token_types: list[int], scores: list[float], *,
                      add_space_prefix: bool, unk_token: str | None = None,
                      rstrip_specials: bool = False) -> tuple[BackendTokenizer, set[int]]:
    """The `tokenizers.Tokenizer` of a SentencePiece vocabulary, and the ids made special.

    No BOS/EOS handling here (gguf_vocab adds the post-processor)."""
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]))
    if len(tokens[longest]) > MAX_TOKEN_CHARS:
        raise ModelLoadError(f"SentencePiece token {longest} has {len(tokens[longest]):,} characters; allowed: at "
                             f"most {MAX_TOKEN_CHARS:,} (a damaged vocabulary?)")
    backend = BackendTokenizer(_bpe_model(tuple(tokens), tuple(scores), unk_token))
    steps = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.append(normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    chain = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        chain.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(chain)
    special, plain, special_ids = _added_tokens(tokens, token_types, rstrip_specials)
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)
    return backend, special_ids
