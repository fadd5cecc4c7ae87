"""Load a GGUF file (llama.cpp format) into HF-named, HF-layout torch tensors."""
from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import LlamaFileType

from quickdraft.config import MAX_CONTEXT, MAX_WIDTH, ModelConfig
from quickdraft.errors import ModelLoadError
from quickdraft.loading import weight_cache
from quickdraft.loading.checkpoint import Checkpoint, LazyTensors, fingerprint
from quickdraft.loading.dequant import SUPPORTED_IDS, dequantize, qtype_name, supported_type_names
from quickdraft.loading.ggml_types import TYPES
from quickdraft.loading.gguf_families import (GGUF_ARCHITECTURES, IGNORED, end_of_turn_texts,
                                              family_fields, fused_rows, hf_targets, is_stacked)
from quickdraft.loading.gguf_metadata import GGUFHeader, int_value, positive_float, read_header, show
from quickdraft.loading.gguf_rope import FloatReader
from quickdraft.loading.tensor_set import check_tensor_set, expected_shapes

log = logging.getLogger(__name__)

# llama.cpp's converter permutes q/k rows of these architectures for its rotary layout.
PERMUTED_ARCHITECTURES = ("llama", "mistral", "mixtral", "smollm3", "granite")


def hf_tensor_types(gguf_types: dict[str, str], experts: dict[str, int] | None = None) -> dict[str, str]:
    """GGML type names by GGUF tensor name -> by HF name (each part of a fused tensor typed as it, each expert of a
    stacked one as the stack where ``experts`` gives the stack's count), with a tied lm_head typed as the embedding it
    reads: what ``load_gguf`` records as ``Checkpoint.tensor_types``."""
    counts = experts or {}
    out = {hf: t for name, t in gguf_types.items() for hf in hf_targets(name, gguf_types, counts.get(name, 0))}
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
    """EOS ids: the declared eos (and eot/eom) ids, plus the end-of-turn tokens the vocabulary has: ChatML's
    ``<|im_end|>``, and per family ``<|endoftext|>`` (qwen2/qwen3), ``<end_of_turn>`` (gemma3), ``<|end|>`` and
    ``<|endoftext|>`` (phi3), ``<|return|>`` and ``<|call|>`` (gpt-oss); ids outside ``vocab_size`` (when given) are
    dropped."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            ids.append(value)
    tokens = metadata.get("tokenizer.ggml.tokens")
    for text in end_of_turn_texts(arch):
        tid = _token_id(tokens, text)
        if tid is not None:
            ids.append(tid)
    if vocab_size is not None:
        ids = [i for i in ids if i < vocab_size]
    return tuple(dict.fromkeys(ids))


def config_from_metadata(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path,
                         read_floats: FloatReader) -> ModelConfig:
    """ModelConfig from GGUF key/values and the tensors' shapes (torch order, keyed by GGUF name), with the family's
    own fields (``gguf_families.family_fields``, which reads RoPE factor tensors through ``read_floats``); every value
    is type- and range-checked (a ModelLoadError names the key, its value and what is allowed)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor (corrupt or incomplete file?)")
    if len(shapes["token_embd.weight"]) != 2:
        raise ModelLoadError(f"{path}: token_embd.weight has shape {shapes['token_embd.weight']}; it must be 2-D "
                             f"(vocabulary x hidden size)")
    hidden = int_value(metadata, f"{arch}.embedding_length", path, 1, MAX_WIDTH)
    heads = int_value(metadata, f"{arch}.attention.head_count", path, 1, MAX_WIDTH)
    kv_heads = int_value(metadata, f"{arch}.attention.head_count_kv", path, 1, heads, default=heads)
    head_dim = int_value(metadata, f"{arch}.attention.key_length", path, 0, MAX_WIDTH, default=0) or hidden // heads
    if head_dim < 2 or head_dim % 2:
        raise ModelLoadError(f"{path}: the head dimension is {head_dim}; rotary embeddings need an even one "
                             f"(check {arch}.attention.key_length, {arch}.embedding_length and head_count)")
    # each layer has at least 9 tensors: more layers than tensors is a damaged count
    num_layers = int_value(metadata, f"{arch}.block_count", path, 1, max(1, len(shapes)))
    vocab = int(shapes["token_embd.weight"][0])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or not 0 <= bos < vocab):
        log.warning("%s: ignoring tokenizer.ggml.bos_token_id %s, not a token id below the vocabulary size %d",
                    path, show(bos), vocab)
        bos = None
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{path}: GGUF metadata 'tokenizer.chat_template' is {show(template)}; "
                             f"it must be a string")
    base = dict(
        architecture=GGUF_ARCHITECTURES[arch], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int_value(metadata, f"{arch}.feed_forward_length", path, 1, MAX_WIDTH),
        num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=int_value(metadata, f"{arch}.context_length", path, 1, MAX_CONTEXT, default=4096),
        rope_theta=positive_float(metadata, f"{arch}.rope.freq_base", path, 10000.0),
        rms_norm_eps=positive_float(metadata, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-6),
        attention_bias="blk.0.attn_q.bias" in shapes or "blk.0.attn_qkv.bias" in shapes,
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=bos,
        eos_token_ids=eos_token_ids(metadata, arch, vocab),
    )
    family = family_fields(arch, metadata, shapes, path, base, read_floats)  # raises its own ModelLoadErrors
    base["architecture"] = family.pop("architecture", base["architecture"])  # llama with experts: mixtral
    try:
        return ModelConfig(**base, **family)
    except (ValueError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"{path}: inconsistent GGUF metadata: {exc}") from exc


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


@dataclass
class TensorRecord:
    """Where one tensor's blocks lie in the GGUF file and how they are stored."""

    gguf_name: str
    qtype: int  # GGML type id
    shape: tuple[int, ...]  # torch order (the GGUF dims reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFIndex:
    """What a load needs from a GGUF header. Parsing the header takes seconds for a large vocabulary (gguf-py decodes
    every token string), so the weight cache keeps this as JSON and a later load of the same file reads only that."""

    config: ModelConfig
    metadata: dict[str, Any]
    quantization: str
    tensors: dict[str, TensorRecord]  # by HF name; a tied lm_head has none of its own

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "metadata": self.metadata, "quantization": self.quantization,
                "tensors": {k: asdict(r) for k, r in self.tensors.items()}}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> GGUFIndex:
        """Raises KeyError/TypeError/ValueError on a damaged record."""
        tensors = {k: TensorRecord(r["gguf_name"], int(r["qtype"]), tuple(int(x) for x in r["shape"]), int(r["offset"]),
                                   int(r["nbytes"])) for k, r in record["tensors"].items()}
        return cls(ModelConfig.from_dict(record["config"]), dict(record["metadata"]), str(record["quantization"]), tensors)


def read_index(path: Path) -> GGUFIndex:
    """Parse and check a GGUF header: the config, the metadata and every tensor we use (a ModelLoadError names what is
    missing, damaged or unsupported)."""
    header = read_header(path)  # every count, length, type and offset of the header checked
    shapes = {name: tuple(reversed(dims)) for name, dims, _, _, _ in header.tensors}
    cfg = config_from_metadata(header.metadata, shapes, path, _float_reader(path, header))
    records: dict[str, TensorRecord] = {}
    for name, _, qtype, offset, nbytes in header.tensors:
        stacked = is_stacked(name)
        # a stack is experts x rows x columns, or experts x rows for the experts' biases
        targets = hf_targets(name, shapes, shapes[name][0] if stacked and len(shapes[name]) in (2, 3) else 0)
        if not targets:
            if not IGNORED.match(name) and not stacked:
                log.warning("%s: ignoring unknown tensor %s", path.name, name)
            elif stacked:
                raise ModelLoadError(f"{path}: tensor {name} has shape {shapes[name]}; a stack of experts is 3-D "
                                     f"(experts x rows x columns), or 2-D for their biases")
            continue
        whole = TensorRecord(name, qtype, shapes[name], offset, nbytes)
        if stacked:
            parts = split_experts(whole, cfg, path)
        else:
            parts = split_rows(whole, fused_rows(targets, cfg), path) if len(targets) > 1 else [whole]
        records.update(zip(targets, parts))
    check_tensor_set({target: r.shape for target, r in records.items()}, cfg, path)
    expected = expected_shapes(cfg)
    unused = sorted({r.gguf_name for target, r in records.items() if target not in expected})
    if unused:  # e.g. a Qwen3 file labelled llama: run without its q/k norms, it would only write nonsense
        raise ModelLoadError(f"{path}: tensor {unused[0]} is not part of a {cfg.architecture!r} model"
                             f"{f' ({len(unused)} such tensors)' if len(unused) > 1 else ''}; is "
                             f"general.architecture right?")
    unsupported = sorted({(qtype_name(r.qtype), r.gguf_name) for r in records.values() if r.qtype not in SUPPORTED_IDS})
    if unsupported:
        types = sorted({tn for tn, _ in unsupported})
        raise ModelLoadError(
            f"{path}: unsupported GGUF quantization type {', '.join(types)} (e.g. tensor {unsupported[0][1]}); "
            f"supported: {supported_type_names()}"
        )
    counts = Counter(qtype_name(r.qtype) for r in records.values())
    return GGUFIndex(cfg, header.metadata, quantization_name(header.metadata, counts), records)


def split_experts(whole: TensorRecord, cfg: ModelConfig, path: Path) -> list[TensorRecord]:
    """A block's stacked experts ``[E, rows, cols]`` (their biases ``[E, rows]``), one record per expert: rows are
    stored whole, so expert e is a contiguous byte range. A stack of another count than the config's is refused by
    name."""
    experts, rows = whole.shape[0], whole.shape[1]
    if experts != cfg.num_experts:
        raise ModelLoadError(f"{path}: tensor {whole.gguf_name} stacks {experts} experts; the config has "
                             f"num_experts={cfg.num_experts} (expert_count)")
    flat = TensorRecord(whole.gguf_name, whole.qtype, (experts * rows, *whole.shape[2:]), whole.offset, whole.nbytes)
    return split_rows(flat, (rows,) * experts, path)


def split_rows(whole: TensorRecord, rows: tuple[int, ...], path: Path) -> list[TensorRecord]:
    """The row ranges of a fused tensor (Phi-3's q/k/v, gate/up), each as a record of its own: GGUF stores rows
    whole, so each range is a contiguous byte range of the file, whatever the type."""
    if whole.shape[0] != sum(rows):
        raise ModelLoadError(f"{path}: tensor {whole.gguf_name} has shape {whole.shape}; the model config needs "
                             f"{' + '.join(f'{n:,}' for n in rows)} = {sum(rows):,} rows in it (its parts one after "
                             f"another)")
    if len(whole.shape) == 1 and TYPES[whole.qtype].block != 1:
        raise ModelLoadError(f"{path}: tensor {whole.gguf_name} is a 1-D {qtype_name(whole.qtype)} tensor; a fused "
                             f"vector must be stored in a float type to be split")
    per_row = whole.nbytes // whole.shape[0]
    out, start = [], 0
    for n in rows:
        out.append(TensorRecord(whole.gguf_name, whole.qtype, (n, *whole.shape[1:]), whole.offset + start * per_row,
                                n * per_row))
        start += n
    return out


def _float_reader(path: Path, header: GGUFHeader) -> FloatReader:
    """Reads a small tensor of the file (RoPE factors) as float64 values; its size is checked before it is read."""
    places = {name: (dims, qtype, offset, nbytes) for name, dims, qtype, offset, nbytes in header.tensors}

    def read(name: str) -> np.ndarray:
        dims, qtype, offset, nbytes = places[name]
        if qtype not in SUPPORTED_IDS:
            raise ModelLoadError(f"{path}: tensor {name} has type {qtype_name(qtype)}; supported: "
                                 f"{supported_type_names()}")
        raw = np.fromfile(path, dtype=np.uint8, count=nbytes, offset=offset)
        return dequantize(raw, qtype, tuple(reversed(dims))).double().numpy()

    return read


ROW_CHUNK = 8192  # rows dequantized at a time: an embedding table never exists in float32 whole


def dequantize_rows(raw: np.ndarray, qtype: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``dequantize`` into a new ``dtype`` tensor, ``ROW_CHUNK`` rows at a time (GGUF rows are stored whole)."""
    if len(shape) != 2 or shape[0] <= ROW_CHUNK:
        return dequantize(raw, qtype, shape).to(dtype).contiguous()
    rows, cols = shape
    per_row = raw.shape[0] // rows
    out = torch.empty(shape, dtype=dtype)
    for r0 in range(0, rows, ROW_CHUNK):
        r1 = min(rows, r0 + ROW_CHUNK)
        out[r0:r1] = dequantize(raw[r0 * per_row:r1 * per_row], qtype, (r1 - r0, cols))
    return out


def rows_reader(raw: np.ndarray, qtype: int, shape: tuple[int, int], dtype: torch.dtype
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A 2-D tensor's rows by index ``[n]``, dequantized to ``dtype`` from its blocks (``raw``) when asked for: the
    bits ``dequantize_rows`` gives those rows of the whole tensor, which a table read a row at a time (an embedding)
    then never needs whole."""
    rows, cols = shape
    geometry = TYPES[qtype]
    row_bytes = cols // geometry.block * geometry.type_size
    if cols % geometry.block or raw.shape[0] != rows * row_bytes:
        raise ModelLoadError(f"a {qtype_name(qtype)} tensor of {rows:,} x {cols:,} needs {rows * row_bytes:,} bytes, "
                             f"the file holds {raw.shape[0]:,} (corrupt or truncated file?)")
    table = raw.reshape(rows, row_bytes)

    def rows_of(ids: torch.Tensor) -> torch.Tensor:
        picked = np.ascontiguousarray(table[ids.numpy()])
        return dequantize(picked.reshape(-1), qtype, (len(ids), cols)).to(dtype)

    return rows_of


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, *, use_cache: bool = True) -> Checkpoint:
    """A GGUF of a supported family (``gguf_families``) with HF names and layout, each tensor dequantized to ``dtype`` when it is read.

    Only the header is read here (with ``use_cache``, from the weight cache's copy of it after the first load); the
    tensors stay in the file, memory-mapped, until a model is built from them one at a time."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    fp = fingerprint(path)
    index = None
    if use_cache and (record := weight_cache.load_index(fp)) is not None:
        try:
            index = GGUFIndex.from_json(record)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring damaged weight cache record for %s (%s: %s); rebuilding", path.name,
                        type(exc).__name__, exc)
    if index is None:
        index = read_index(path)
        if use_cache:
            weight_cache.store_index(fp, index.to_json())
    cfg, records = index.config, index.tensors
    permute = cfg.architecture in PERMUTED_ARCHITECTURES

    def blocks(name: str) -> np.ndarray:
        r = records[name]
        return np.memmap(path, dtype=np.uint8, mode="r", offset=r.offset, shape=(r.nbytes,))

    def dequantized(name: str) -> torch.Tensor:
        r = records[name]
        with single_thread():
            if permute and r.gguf_name.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
                w = dequantize(blocks(name), r.qtype, r.shape)
                return unpermute_rows(w, cfg.num_heads if ".attn_q." in r.gguf_name else cfg.num_kv_heads).to(dtype)
            return dequantize_rows(blocks(name), r.qtype, r.shape, dtype)

    makers = {name: functools.partial(dequantized, name) for name in records}
    if cfg.tie_word_embeddings:
        makers["lm_head.weight"] = makers["model.embed_tokens.weight"]
    stored = {r.gguf_name: qtype_name(r.qtype) for r in records.values()}
    types = hf_tensor_types(stored, {name: cfg.num_experts for name in stored if is_stacked(name)})
    return Checkpoint(
        config=cfg, tensors=LazyTensors(makers), source=path, fingerprint=fp,
        chat_template=index.metadata.get("tokenizer.chat_template"), gguf_metadata=index.metadata, hf_dir=None,
        quantization=index.quantization, tensor_types=types,
        blocks=LazyTensors({name: functools.partial(blocks, name) for name in records}),
        block_types={name: r.qtype for name, r in records.items()}, dtype=dtype,
    )
