"""Rebuild a HF `tokenizers` tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF file carries no tokenizer.json: it stores the vocabulary, the merges, the token types and
the special token ids under llama.cpp's key names, plus `tokenizer.ggml.pre`, the name of the
pre-tokenizer (the regex that cuts text into words before BPE runs). This module turns those
fields back into a `tokenizers.Tokenizer` that encodes exactly like llama.cpp does for the same
file, which for the supported pre-tokenizers is also exactly what the model's original
tokenizer.json does.

Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Qwen2, Llama 3, ...) and
SentencePiece (`"llama"`: Gemma, Llama 2, Mistral, Phi-3, ...; the model itself is built in `spm_vocab`).
Anything else raises `ModelLoadError` naming what is supported.

This module must not import `quickdraft.loading` (the loading layer sits on top of it): it takes
the metadata as a plain dict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from quickdraft.errors import ModelLoadError
from quickdraft.tokenizer.spm_vocab import (
    build_spm_backend,
    check_scores,
    is_phi3,
    llama_cpp_token_types,
)

# llama.cpp's token types (gguf.TokenType / llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
_MODEL_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# llama.cpp's SPM defaults when the file declares no (or an out-of-range) bos / eos / unknown id
_SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as in llama.cpp's llama-vocab.cpp (llm_tokenizer_bpe) and in the models'
# own tokenizer.json files. llama.cpp spells `(?i:'s|...)` as explicit case classes because
# std::regex lacks inline flags; the Oniguruma engine in `tokenizers` takes the original form.
# ---------------------------------------------------------------------------------------------

# GPT-2's split, the one `ByteLevel(use_regex=True)` applies by itself:
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2_SPLIT = None  # marker: use ByteLevel's built-in GPT-2 regex

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` value cuts text before BPE.

    split: a regex applied with "isolated" behaviour, or GPT2_SPLIT (None) for GPT-2's regex.
    individual_digits: cut every digit into its own word first (StarCoder / SmolLM).
    ignore_merges: a word that is itself a vocabulary entry is taken whole (Llama 3).
    add_bos: llama.cpp's default for add_bos when the file has no `tokenizer.ggml.add_bos_token`.
    """

    split: str | None
    individual_digits: bool = False
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreTokenizerSpec(GPT2_SPLIT)
_STARCODER = PreTokenizerSpec(GPT2_SPLIT, individual_digits=True)
_LLAMA3 = PreTokenizerSpec(LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_LLAMA3_LIKE = PreTokenizerSpec(LLAMA3_SPLIT)  # same regex, llama.cpp keeps merges / no default BOS
_QWEN2 = PreTokenizerSpec(QWEN2_SPLIT)

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    # GPT-2 regex. "default" (and a missing key) is what old converters wrote when they did not
    # know the pre-tokenizer; GPT-2's regex is the sensible fallback (it is also what
    # transformers uses for files it does not recognise). llama.cpp spells GPT-2 "gpt-2";
    # "gpt2" is accepted too.
    **dict.fromkeys(
        ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
         "gigachat", "mellum", "a.x-4.0", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "jina-v1-en",
         "jina-v2-code", "roberta-bpe"),
        _GPT2,
    ),
    # digits one by one, then GPT-2's regex
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _STARCODER),
    # Llama 3 family
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), _LLAMA3_LIKE),
    # Qwen2 family
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"), _QWEN2),
    "qwen35": PreTokenizerSpec(QWEN35_SPLIT),
    "tekken": PreTokenizerSpec(TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), PreTokenizerSpec(GPT4O_SPLIT)),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level "alphabet")."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@dataclass
class GGUFVocab:
    """What `build_from_gguf_metadata` returns: the backend plus the facts the Tokenizer needs."""

    backend: BackendTokenizer
    tokens: list[str]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool
    special_ids: frozenset[int] = field(default_factory=frozenset)
    pre_tokenizer: str = "default"


def _get(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    return default if value is None else value


def _token_id(metadata: dict[str, Any], key: str, n_tokens: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"GGUF field {key} must be an integer token id, got {value!r}") from None
    if not 0 <= value < n_tokens:
        # llama.cpp treats out-of-range ids (often -1 / 0xFFFFFFFF) as "no such token"
        return None
    return value


def _pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if spec.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    if bos is None and eos is None:
        return None
    specials = [x for x in (bos, eos) if x is not None]
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + (([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


def build_from_gguf_metadata(metadata: dict[str, Any]) -> GGUFVocab:
    """Build the tokenizer a GGUF file describes. Raises ModelLoadError on anything unsupported."""
    if not isinstance(metadata, dict):
        raise ModelLoadError(f"GGUF metadata must be a dict of fields, got {type(metadata).__name__}")
    model = metadata.get("tokenizer.ggml.model")
    supported = ", ".join(f"{m} ({_MODEL_KINDS[m]})" for m in SUPPORTED_TOKENIZER_MODELS)
    if model is None:
        raise ModelLoadError(
            f"GGUF file has no tokenizer (no tokenizer.ggml.model field); supported tokenizer models: {supported}"
        )
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r}; supported tokenizer models: {supported}")
    if model == "llama":
        return _build_sentencepiece(metadata)
    return _build_byte_level_bpe(metadata)


def _read_tokens(metadata: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The token strings and their llama.cpp types (all normal when the file has none), checked."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError("GGUF field tokenizer.ggml.tokens must be a non-empty list of strings")
    n = len(tokens)
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        token_types = [TOKEN_NORMAL] * n
    elif not isinstance(token_types, list) or len(token_types) != n:
        raise ModelLoadError(
            f"GGUF field tokenizer.ggml.token_type has {len(token_types) if isinstance(token_types, list) else '?'} "
            f"entries but tokenizer.ggml.tokens has {n}"
        )
    return tokens, [int(t) for t in token_types]


def _read_merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    """The BPE merges, each stored as two tokens separated by a space."""
    merges_field = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges_field, list):
        raise ModelLoadError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges list")
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(merges_field):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise ModelLoadError(f"GGUF tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens separated by a space")
        merges.append((parts[0], parts[1]))
    return merges


def _pre_tokenizer_spec(metadata: dict[str, Any]) -> tuple[str, PreTokenizerSpec]:
    """The file's pre-tokenizer name and how it cuts text; unknown names are refused, not guessed."""
    pre_name = _get(metadata, "tokenizer.ggml.pre", "default")
    spec = PRE_TOKENIZERS.get(pre_name)
    if spec is None:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre_name!r}; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return pre_name, spec


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token spelling -> id, every spelling in GPT-2's byte alphabet.

    A token using any other character (rare: some added tokens are stored as plain text) is re-spelled from its
    UTF-8 bytes so that the BPE model and the ByteLevel decoder agree on it. Duplicate spellings keep their
    first id."""
    byte_map = bytes_to_unicode()
    alphabet = set(byte_map.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not token:  # llama.cpp renames empty entries "[EMPTY_i]"; here they simply decode to ""
            continue
        spelled = token if set(token) <= alphabet else "".join(byte_map[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    return vocab


def _bpe_backend(vocab: dict[str, int], merges: list[tuple[str, str]], spec: PreTokenizerSpec) -> BackendTokenizer:
    """The byte-level BPE tokenizer itself, before added tokens and the post-processor."""
    bpe = BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
              end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=spec.ignore_merges)
    backend = BackendTokenizer(bpe)
    backend.normalizer = None
    backend.pre_tokenizer = _pre_tokenizer(spec)
    backend.decoder = decoders.ByteLevel()
    return backend


def _register_added_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int],
                        vocab: dict[str, int]) -> set[int]:
    """Register CONTROL and USER_DEFINED tokens as added tokens; returns the ids made special.

    CONTROL tokens (<|im_start|>, <|endoftext|>, ...) become special added tokens and USER_DEFINED ones
    (<tool_call>, <think>, ...) non-special added tokens: both are matched whole in the text, like llama.cpp's
    tokenizer_st_partition and HF's added tokens. A token marked CONTROL that is not spelled in the byte alphabet
    is a converter mislabel and is left alone (as transformers does). Added tokens already in the vocabulary keep
    the id the file gives them."""
    alphabet = set(bytes_to_unicode().values())
    whole = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    control: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    special_ids: set[int] = set()
    for index, (token, ttype) in enumerate(zip(tokens, token_types)):
        if ttype == TOKEN_CONTROL and token and set(token) <= alphabet:
            control.append(AddedToken(token, **whole, special=True))
            special_ids.add(index)
        elif ttype == TOKEN_USER_DEFINED and token and token in vocab:
            user_defined.append(AddedToken(token, **whole, special=False))
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)
    return special_ids


def _build_byte_level_bpe(metadata: dict[str, Any]) -> GGUFVocab:
    """The tokenizer of a byte-level BPE (``gpt2``) vocabulary, with the BOS/EOS handling the file asks for."""
    tokens, token_types = _read_tokens(metadata)
    merges = _read_merges(metadata)
    pre_name, spec = _pre_tokenizer_spec(metadata)
    vocab = _byte_level_vocab(tokens)
    backend = _bpe_backend(vocab, merges, spec)
    special_ids = _register_added_tokens(backend, tokens, token_types, vocab)
    return _finish(metadata, backend, tokens, token_types, special_ids, pre_name, add_bos_default=spec.add_bos)


def _build_sentencepiece(metadata: dict[str, Any]) -> GGUFVocab:
    """The tokenizer of a SentencePiece (``llama``) vocabulary, encoding as llama.cpp's SPM tokenizer does."""
    tokens, token_types = _read_tokens(metadata)
    declared = {k[len("tokenizer.ggml."):-len("_token_id")] for k in metadata
                if k.startswith("tokenizer.ggml.") and k.endswith("_token_id") and metadata[k] is not None}
    token_types = llama_cpp_token_types(tokens, token_types, declared)
    scores = check_scores(metadata.get("tokenizer.ggml.scores"), len(tokens))
    unk = _token_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
    unk = _SPM_DEFAULT_IDS["unknown"] if unk is None else unk
    unk_token = tokens[unk] if unk < len(tokens) and tokens[unk] else None
    backend, special_ids = build_spm_backend(
        tokens, token_types, scores,
        add_space_prefix=bool(_get(metadata, "tokenizer.ggml.add_space_prefix", True)),  # llama.cpp: true for SPM
        unk_token=unk_token,
        rstrip_specials=is_phi3(metadata.get("general.name")),
    )
    pre_name = _get(metadata, "tokenizer.ggml.pre", "default")  # llama.cpp ignores it for SPM
    return _finish(metadata, backend, tokens, token_types, special_ids, pre_name, add_bos_default=True,
                   default_ids=_SPM_DEFAULT_IDS)


def _finish(metadata: dict[str, Any], backend: BackendTokenizer, tokens: list[str], token_types: list[int],
            special_ids: set[int], pre_name: str, add_bos_default: bool,
            default_ids: dict[str, int] | None = None) -> GGUFVocab:
    """The special ids, the BOS/EOS flags and the post-processor that adds them, common to every model."""
    n = len(tokens)
    ids = {k: _token_id(metadata, f"tokenizer.ggml.{k}_token_id", n) for k in ("bos", "eos", "unknown", "padding")}
    for key, default in (default_ids or {}).items():
        if ids[key] is None and default < n:
            ids[key] = default
    bos, eos = ids["bos"], ids["eos"]
    extra_eos = tuple(
        i for i in (_token_id(metadata, f"tokenizer.ggml.{k}_token_id", n) for k in ("eot", "eom")) if i is not None
    )
    add_bos = bool(_get(metadata, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(_get(metadata, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    for tid in (bos, eos):
        if tid is not None and token_types[tid] == TOKEN_CONTROL:
            special_ids.add(tid)

    # BOS/EOS insertion lives in the post-processor, like in a tokenizer.json
    backend.post_processor = _post_processor(
        (tokens[bos], bos) if add_bos else None,
        (tokens[eos], eos) if add_eos else None,
    )

    return GGUFVocab(
        backend=backend,
        tokens=list(tokens),
        token_types=token_types,
        bos_token_id=bos,
        eos_token_id=eos,
        unk_token_id=ids["unknown"],
        pad_token_id=ids["padding"],
        extra_eos_token_ids=extra_eos,
        add_bos=add_bos,
        add_eos=add_eos,
        special_ids=frozenset(special_ids),
        pre_tokenizer=pre_name,
    )
