"""Load a GGUF file (llama.cpp format) into HF-named, HF-layout torch tensors."""
from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, LlamaFileType

from quickdraft.config import SUPPORTED_ARCHITECTURES, ModelConfig
from quickdraft.errors import ModelLoadError
from quickdraft.loading import weight_cache
from quickdraft.loading.checkpoint import Checkpoint, fingerprint
from quickdraft.loading.dequant import SUPPORTED_TYPES, dequantize, qtype_name, supported_type_names
from quickdraft.loading.gguf_metadata import open_gguf, read_metadata

log = logging.getLogger(__name__)

# llama.cpp's converter permutes q/k rows of these architectures for its rotary layout.
PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Present in some llama GGUFs, not needed by our model (rotary tables are recomputed).
_IGNORED = re.compile(r"(rope_freqs\.weight|blk\.\d+\.attn_rot_embd.*)$")


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None when the tensor is not one we use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (``reshape(n_head, 2, dim, ...).swapaxes(1, 2)``)
    so rows follow HF's rotate-half layout; works for weights and biases."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one thread: dequantizing and quantizing are many small memory-bound ops,
    and on a busy machine intra-op thread sync made them 10-30x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _token_id(tokens: list[str] | None, text: str) -> int | None:
    if not tokens:
        return None
    try:
        return tokens.index(text)
    except ValueError:
        return None


def eos_token_ids(metadata: dict[str, Any], arch: str) -> tuple[int, ...]:
    """EOS ids: the declared eos (and eot/eom) ids, plus the ChatML end-of-turn token
    ``<|im_end|>`` when the vocab has it, and for qwen2 also ``<|endoftext|>``."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if isinstance(value, int) and value >= 0:
            ids.append(value)
    tokens = metadata.get("tokenizer.ggml.tokens")
    extra = ["<|im_end|>"] + (["<|endoftext|>"] if arch == "qwen2" else [])
    for text in extra:
        tid = _token_id(tokens, text)
        if tid is not None:
            ids.append(tid)
    return tuple(dict.fromkeys(ids))


def _required(metadata: dict[str, Any], key: str, path: Path) -> Any:
    value = metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata is missing {key!r} (corrupt or incomplete file?)")
    return value


def config_from_metadata(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path) -> ModelConfig:
    """ModelConfig from GGUF key/values and the tensors' shapes (torch order, keyed by GGUF name)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor (corrupt or incomplete file?)")
    hidden = int(_required(metadata, f"{arch}.embedding_length", path))
    heads = int(_required(metadata, f"{arch}.attention.head_count", path))
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = metadata.get(f"{arch}.attention.key_length") or hidden // heads
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        log.warning("%s: rope scaling %r is not supported; using plain RoPE", path, scaling)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(shapes["token_embd.weight"][0]),
            hidden_size=hidden,
            intermediate_size=int(_required(metadata, f"{arch}.feed_forward_length", path)),
            num_layers=int(_required(metadata, f"{arch}.block_count", path)),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(metadata.get(f"{arch}.context_length", 4096)),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            attention_bias="blk.0.attn_q.bias" in shapes,
            tie_word_embeddings="output.weight" not in shapes,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_token_ids(metadata, arch),
        )
    except (ValueError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"{path}: inconsistent GGUF metadata: {exc}") from exc


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a checkpoint of this config (lm_head only when untied)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
    return out


def check_tensor_set(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, source: Path) -> None:
    """Raise ModelLoadError when a needed tensor is missing or has the wrong shape."""
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: checkpoint is missing tensors {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(shapes[name])}, expected {shape} from the model config"
            )


def quantization_name(metadata: dict[str, Any], type_counts: Counter) -> str:
    """llama.cpp's file type name (e.g. 'Q4_K_M'), else the most common non-float type."""
    ftype = metadata.get("general.file_type")
    if isinstance(ftype, int):
        try:
            return LlamaFileType(ftype).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    quantized = [(n, t) for t, n in type_counts.items() if t not in ("F32",)]
    return max(quantized)[1] if quantized else "F32"


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, *, use_cache: bool = True, progress: bool = True
) -> Checkpoint:
    """Load a llama / mistral / qwen2 GGUF, dequantized to ``dtype``, with HF names and layout.

    With ``use_cache`` the converted tensors (and the metadata) are kept in the
    weight cache, so loading the same file again is a memory map.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    fp = fingerprint(path)
    if use_cache:
        hit = weight_cache.load_cached(fp, dtype)
        if hit is not None:
            tensors, info = hit
            cfg_dict = info["config"]
            cfg_dict["eos_token_ids"] = tuple(cfg_dict["eos_token_ids"])
            metadata = info["metadata"]
            log.info("loaded %s from the weight cache", path.name)
            return Checkpoint(
                config=ModelConfig(**cfg_dict), tensors=tensors, source=path, fingerprint=fp,
                chat_template=metadata.get("tokenizer.chat_template"), gguf_metadata=metadata, hf_dir=None,
                quantization=info["quantization"],
            )

    reader = open_gguf(path)
    file_size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise ModelLoadError(
                f"{path} is truncated or corrupt: tensor {t.name} needs bytes up to {end:,} "
                f"but the file has {file_size:,} bytes"
            )
    if reader.byte_order != "I":
        raise ModelLoadError(f"{path} is a big-endian GGUF; only little-endian files are supported")
    try:
        metadata = read_metadata(reader)
    except Exception as exc:
        raise ModelLoadError(f"{path} is a corrupt GGUF file: cannot decode metadata ({exc})") from exc

    by_name = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(x) for x in reversed(t.shape.tolist())) for name, t in by_name.items()}
    cfg = config_from_metadata(metadata, shapes, path)

    selected = []
    for name, t in by_name.items():
        target = hf_name(name)
        if target is None:
            if not _IGNORED.match(name):
                log.warning("%s: ignoring unknown tensor %s", path.name, name)
            continue
        selected.append((name, target, t))
    check_tensor_set({target: shapes[name] for name, target, _ in selected}, cfg, path)
    unsupported = sorted({(qtype_name(t.tensor_type), name) for name, _, t in selected if t.tensor_type not in SUPPORTED_TYPES})
    if unsupported:
        types = sorted({tn for tn, _ in unsupported})
        raise ModelLoadError(
            f"{path}: unsupported GGUF quantization type {', '.join(types)} (e.g. tensor {unsupported[0][1]}); "
            f"supported: {supported_type_names()}"
        )

    permute = cfg.architecture in PERMUTED_ARCHITECTURES
    tensors: dict[str, torch.Tensor] = {}
    counts: Counter = Counter()
    start = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(selected, desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False)
    with single_thread():
        for name, target, t in bar:
            counts[GGMLQuantizationType(t.tensor_type).name] += 1
            w = dequantize(t.data, t.tensor_type, shapes[name])
            if permute and (".attn_q." in name or ".attn_k." in name):
                w = unpermute_rows(w, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
            tensors[target] = w.to(dtype).contiguous()
    del reader, by_name, selected
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    log.info("dequantized %s in %.1fs", path.name, time.perf_counter() - start)

    quant = quantization_name(metadata, counts)
    if use_cache:
        weight_cache.store(
            fp, dtype, tensors, cfg.tie_word_embeddings,
            {"config": asdict(cfg), "metadata": metadata, "quantization": quant, "source": str(path)},
        )
    return Checkpoint(
        config=cfg, tensors=tensors, source=path, fingerprint=fp,
        chat_template=metadata.get("tokenizer.chat_template"), gguf_metadata=metadata, hf_dir=None,
        quantization=quant,
    )
