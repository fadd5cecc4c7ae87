"""Load a GGUF file (llama.cpp format) into HF-named, HF-layout torch tensors."""
from __future__ import annotations

import contextlib
import logging
import math
import re
import reprlib
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
from quickdraft.loading.gguf_metadata import open_gguf, read_metadata, tensor_types

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


def hf_tensor_types(gguf_types: dict[str, str]) -> dict[str, str]:
    """GGML type names by GGUF tensor name -> by HF name, with a tied lm_head typed as the embedding it reads."""
    out = {hf: t for name, t in gguf_types.items() if (hf := hf_name(name)) is not None}
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (``reshape(n_head, 2, dim, ...).swapaxes(1, 2)``)
    so rows follow HF's rotate-half layout; works for weights and biases."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one thread: dequantizing and quantizing are many small memory-bound ops, and on a busy
    machine intra-op thread sync made them many times slower than one thread (docs/MEASUREMENTS.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _token_id(tokens: Any, text: str) -> int | None:
    if not isinstance(tokens, list):
        return None
    try:
        return tokens.index(text)
    except ValueError:
        return None


def eos_token_ids(metadata: dict[str, Any], arch: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """EOS ids: the declared eos (and eot/eom) ids, plus the ChatML end-of-turn token
    ``<|im_end|>`` when the vocab has it, and for qwen2 also ``<|endoftext|>``; ids outside
    ``vocab_size`` (when given) are dropped."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            ids.append(value)
    tokens = metadata.get("tokenizer.ggml.tokens")
    extra = ["<|im_end|>"] + (["<|endoftext|>"] if arch == "qwen2" else [])
    for text in extra:
        tid = _token_id(tokens, text)
        if tid is not None:
            ids.append(tid)
    if vocab_size is not None:
        ids = [i for i in ids if i < vocab_size]
    return tuple(dict.fromkeys(ids))


def _required(metadata: dict[str, Any], key: str, path: Path) -> Any:
    value = metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata is missing {key!r} (corrupt or incomplete file?)")
    return value


def _int(metadata: dict[str, Any], key: str, path: Path, low: int, high: int, default: int | None = None) -> int:
    """An integer metadata value in ``[low, high]`` (required unless it has a default)."""
    value = _required(metadata, key, path) if default is None else metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {_show(value)}; it must be an integer")
    if not low <= value <= high:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {value:,}; allowed: {low:,} to {high:,}")
    return value


def _positive_float(metadata: dict[str, Any], key: str, path: Path, default: float) -> float:
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {_show(value)}; it must be a positive finite number")
    return float(value)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


# Bounds on the config's sizes, far above any real model (widths of ~16k, contexts of up to ~10M tokens): a
# damaged value is refused here rather than sizing a loop or an allocation (the rotary table has a row per position).
MAX_WIDTH = 1 << 20
MAX_CONTEXT = 1 << 24


def config_from_metadata(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path) -> ModelConfig:
    """ModelConfig from GGUF key/values and the tensors' shapes (torch order, keyed by GGUF name);
    every value is type- and range-checked (a ModelLoadError names the key, its value and what is allowed)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor (corrupt or incomplete file?)")
    if len(shapes["token_embd.weight"]) != 2:
        raise ModelLoadError(f"{path}: token_embd.weight has shape {shapes['token_embd.weight']}; it must be 2-D "
                             f"(vocabulary x hidden size)")
    hidden = _int(metadata, f"{arch}.embedding_length", path, 1, MAX_WIDTH)
    heads = _int(metadata, f"{arch}.attention.head_count", path, 1, MAX_WIDTH)
    kv_heads = _int(metadata, f"{arch}.attention.head_count_kv", path, 1, heads, default=heads)
    head_dim = _int(metadata, f"{arch}.attention.key_length", path, 0, MAX_WIDTH, default=0) or hidden // heads
    if head_dim < 2 or head_dim % 2:
        raise ModelLoadError(f"{path}: the head dimension is {head_dim}; rotary embeddings need an even one "
                             f"(check {arch}.attention.key_length, {arch}.embedding_length and head_count)")
    # each layer has at least 9 tensors: more layers than tensors is a damaged count
    num_layers = _int(metadata, f"{arch}.block_count", path, 1, max(1, len(shapes)))
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        log.warning("%s: rope scaling %r is not supported; using plain RoPE", path, scaling)
    vocab = int(shapes["token_embd.weight"][0])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or not 0 <= bos < vocab):
        log.warning("%s: ignoring tokenizer.ggml.bos_token_id %s, not a token id below the vocabulary size %d",
                    path, _show(bos), vocab)
        bos = None
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{path}: GGUF metadata 'tokenizer.chat_template' is {_show(template)}; "
                             f"it must be a string")
    intermediate = _int(metadata, f"{arch}.feed_forward_length", path, 1, MAX_WIDTH)
    context = _int(metadata, f"{arch}.context_length", path, 1, MAX_CONTEXT, default=4096)
    rope_theta = _positive_float(metadata, f"{arch}.rope.freq_base", path, 10000.0)
    eps = _positive_float(metadata, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-6)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=context,
            rope_theta=rope_theta,
            rms_norm_eps=eps,
            attention_bias="blk.0.attn_q.bias" in shapes,
            tie_word_embeddings="output.weight" not in shapes,
            bos_token_id=bos,
            eos_token_ids=eos_token_ids(metadata, arch, vocab),
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
            try:  # a cache entry whose record does not make a config is damaged: rebuild it from the GGUF
                cfg_dict = dict(info["config"])
                cfg_dict["eos_token_ids"] = tuple(cfg_dict["eos_token_ids"])
                cfg, metadata, quant = ModelConfig(**cfg_dict), dict(info["metadata"]), str(info["quantization"])
                types = info.get("tensor_types")  # absent from records written before it was kept
                types = dict(types) if types is not None else hf_tensor_types(tensor_types(path))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring damaged weight cache record for %s (%s: %s); rebuilding", path.name,
                            type(exc).__name__, exc)
            else:
                log.info("loaded %s from the weight cache", path.name)
                return Checkpoint(
                    config=cfg, tensors=tensors, source=path, fingerprint=fp,
                    chat_template=metadata.get("tokenizer.chat_template"), gguf_metadata=metadata, hf_dir=None,
                    quantization=quant, tensor_types=types,
                )

    reader = open_gguf(path)  # every count, length, type and offset of the header checked
    if reader.byte_order != "I":
        raise ModelLoadError(f"{path} is a big-endian GGUF; only little-endian files are supported")
    try:
        metadata = read_metadata(reader)
    except Exception as exc:
        raise ModelLoadError(f"{path} is a corrupt GGUF file: cannot decode metadata ({exc})") from exc

    by_name = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(x) for x in reversed(t.shape.tolist())) for name, t in by_name.items()}
    types = hf_tensor_types({name: qtype_name(t.tensor_type) for name, t in by_name.items()})
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
            {"config": asdict(cfg), "metadata": metadata, "quantization": quant, "source": str(path),
             "tensor_types": types},
        )
    return Checkpoint(
        config=cfg, tensors=tensors, source=path, fingerprint=fp,
        chat_template=metadata.get("tokenizer.chat_template"), gguf_metadata=metadata, hf_dir=None,
        quantization=quant, tensor_types=types,
    )
