"""quickdraft's CPU kernels in C: built on first use, loaded, called.

Four sources make one library: ``qmatmul.c`` (weight-only quantized linear layers: int4/int8 and the GGML block
formats of ``qformats.h``, see ``qmatmul.py``), ``cpu_ops.c`` (RMSNorm, rotary embedding, the MLP's gated
activation: the small per-token operations whose torch dispatch cost as much as the matmuls in a decode step),
``attention.c`` (decode and verify attention over the paged cache, in its stored format, whole or within a sliding
window; ``kv.h``) and ``layer.c`` (a whole decoder layer in one call, a mixture of experts' router and experts).
Each computes every result row with the same operations whatever the batch and thread count (bit-identical rows,
which speculative verification relies on).

The library is compiled with the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``)
into ``cache_root()/kernels/`` (``native_build.py``: its objects side by side) and linked against the OpenMP
runtime torch already loaded, so it shares torch's threads. It needs AVX2, FMA and F16C (x86-64 server CPUs since
2013-2015) and uses AVX512, AVX512-VNNI / AVX-VNNI and AVX512-BF16 where the CPU has them; the quantized kernel's
integer sums are the same on every ISA. Where it cannot be built (no compiler, no AVX2, not x86-64) ``available()``
is False and the model runs torch's operations; ``QUICKDRAFT_KERNELS=0`` turns it off. A compiler that runs longer
than ``COMPILE_TIMEOUT_S`` is killed (the same fallback, with a warning), and a cached library that no longer
matches the checksum recorded beside it (``.sha256``), or does not load, is rebuilt once.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quickdraft.models import native_build
from quickdraft.models.native_build import ISA_ENV, build_flags, cpu_flags  # noqa: F401 - callers read them here

log = logging.getLogger(__name__)

DISABLE_ENV = "QUICKDRAFT_KERNELS"
MAX_HEAD_DIM = 256
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # the cache formats the kernels read (kv.h)
KV_SCALE_GROUP = 32  # int8 cache values per float32 scale (QGROUP in kv.h)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "clamped_swiglu": 2}  # qd_gated's (cpu_ops.c), as the MLPs name them

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "qd_linear": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _P, _I],
    "qd_rmsnorm": [_P, _I, _P, _I, _I, _I, _F, _P], "qd_rope": [_P, _I, _I, _I, _I, _I, _L, _P, _P, _P],
    "qd_attend": [_P, _L, _I, _I, _I, _I, _P, _P, _F, _I, _P, _F, _P],
    "qd_kv_store": [_P, _L, _I, _I, _I, _I, _P, _P, _P, _I],
    "qd_linear_bf16": [_P, _I, _I, _P, _I, _P, _P],
    "qd_gated": [_P, _I, _I, _I, _I, _F, _F, _P], "qd_decoder_layer": [_P, _P, _I, _I, _P, _P, _P, _P, _P, _I],
    "qd_argmax": [_P, _I, _I, _L, _P], "qd_moe": [_P, _P, _I, _P, _I, _I, _I, _I, _P, _P, _I, _F, _F, _P],
    "qd_route": [_P, _I, _I, _I, _P, _P, _I, _I, _I, _P, _P],
    "qd_decoder_stack": [_P, _I, _P, _I, _I, _P, _P, _P, _L, _L, _P, _P],
    "qd_row_bytes": [_I, _I], "qd_release_threads": [], "qd_dry_repeats": [_P, _I, _I, _P],
    "qd_row_logprobs": [_P, _I, _I, _L, _P, _I, _P, _P, _P, _P],
    "qd_lora_add": [_P, _I, _L, _P, _I, _L, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P],
}
_RESTYPES = {"qd_row_bytes": ctypes.c_long}  # the others return 0 or an error code


def wide_int8_dot_products() -> bool:
    """True where the quantized kernel runs 512-bit VNNI dot products (AVX512-VNNI/BW/VL/DQ, the ``WIDE`` build of
    qmatmul.c). There an int4 forward beats a bfloat16 one at every prompt length measured, so a quantized draft keeps
    no float copy for long prompts (docs/MEASUREMENTS.md)."""
    wide = {"avx512_vnni", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    return available() and wide and "-mno-avx512f" not in build_flags()


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _RESTYPES.get(name, ctypes.c_int), argtypes
    return lib


def _build_and_open(compiler: str) -> ctypes.CDLL:
    """The cached library, built first if missing; a cached file that is damaged or does not load (or lacks a
    kernel) is rebuilt once."""
    target = native_build.library_path(compiler)
    if target.is_file():
        problem = native_build.damage(target)
        if problem is None:
            try:
                return _open(target)
            except (OSError, AttributeError) as exc:
                problem = f"does not load ({exc})"
        log.warning("the cached quickdraft CPU kernel library %s %s; rebuilding it", target, problem)
    native_build.compile_library(compiler, target)
    return _open(target)


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is not None:  # the common case, without the lock (called for every small op)
        return _lib
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        compiler = native_build.find_compiler()
        _error = _not_here(compiler)
        if _error is not None:
            return None
        try:
            _lib = _build_and_open(compiler)
        except subprocess.TimeoutExpired:
            _error = f"{compiler} did not finish within {native_build.COMPILE_TIMEOUT_S:g} s (COMPILE_TIMEOUT_S)"
            log.warning("quickdraft CPU kernels unavailable, using torch's operations (%s)", _error)
        except Exception as exc:  # no AVX2 (#error in the source), compiler missing headers, ...
            _error = f"{type(exc).__name__}: {exc}"
            log.info("quickdraft CPU kernels unavailable, using torch's operations (%s)", _error)
        return _lib


def available() -> bool:
    """True when the library is built (or was just built) and loaded for this CPU."""
    return _load() is not None


def can_build() -> bool:
    """Whether the library is loaded, or could be built here, without building it: not turned off, an x86-64 CPU
    with AVX2, FMA and F16C, a C compiler. What a listing plans with (``quickdraft models``); a load builds it, and a
    build that fails then leaves torch's operations."""
    if _lib is not None or _error is not None:
        return _lib is not None
    return _not_here(native_build.find_compiler()) is None and {"avx2", "fma", "f16c"} <= cpu_flags()


def _not_here(compiler: str | None) -> str | None:
    """Why the library is not built here, whatever the sources say, or None."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"turned off by {DISABLE_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64") or compiler is None:
        return "needs an x86-64 CPU and a C compiler"
    return None


def unavailable_reason() -> str | None:
    _load()
    return _error


def lib() -> ctypes.CDLL:
    loaded = _load()
    if loaded is None:
        raise RuntimeError(f"quickdraft CPU kernels unavailable: {_error}")
    return loaded


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} failed ({'out of memory' if rc == -1 else 'bad arguments'}, code {rc})")


def _float_kind(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)


def runs_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _float_kind(x) and _float_kind(weight) and x.shape[-1] % 8 == 0 and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, in float32, rounded once to x's dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[-1]
    _check(lib().qd_rmsnorm(x.data_ptr(), int(x.dtype == torch.bfloat16), weight.data_ptr(),
                            int(weight.dtype == torch.bfloat16), x.numel() // d, d, eps, y.data_ptr()), "qd_rmsnorm")
    return y


def runs_rope(x: torch.Tensor) -> bool:
    """x: ``[T, heads, D]`` with contiguous heads (a view of a fused q/k/v output is fine)."""
    return (_float_kind(x) and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[2] % 2 == 0 and available())


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [T, heads, D]`` in place over the first ``2 * R`` dims of each head;
    ``cos``/``sin``: float32 ``[max_pos, R]`` (R = D / 2 but for partial rotary), ``positions``: int64 ``[T]``."""
    t, heads, d = x.shape
    _check(lib().qd_rope(x.data_ptr(), int(x.dtype == torch.bfloat16), t, heads, d, cos.shape[1], x.stride(0),
                         positions.data_ptr(), cos.data_ptr(), sin.data_ptr()), "qd_rope")
    return x


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias float32 [N])``, all bfloat16 but the bias, float32 sums (of AVX512-BF16
    pair products where the CPU has them, else of AVX2 fma); each output row computed on its own (bit-identical
    whatever M)."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    _check(lib().qd_linear_bf16(x.data_ptr(), m, k, weight.data_ptr(), n, None if bias is None else bias.data_ptr(),
                                y.data_ptr()), "qd_linear_bf16")
    return y


def runs_gated(gate_up: torch.Tensor) -> bool:
    return _float_kind(gate_up) and gate_up.shape[-1] % 2 == 0 and available()


def gated(gate_up: torch.Tensor, act: str, limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up [..., 2N] = [gate | up]`` (float32 or bfloat16 on CPU), in float32 and rounded
    once; ``act``: ``silu``, ``gelu_tanh`` (torch's ``gelu(approximate="tanh")``) or gpt-oss's ``clamped_swiglu``
    (``limit``, ``alpha``). The fused decoder layer and ``qd_moe`` (``layer.c``) apply the same kernel."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    y = gate_up.new_empty(*gate_up.shape[:-1], n)
    _check(lib().qd_gated(gate_up.data_ptr(), int(gate_up.dtype == torch.bfloat16), gate_up.numel() // (2 * n), n,
                          ACTIVATIONS[act], limit, alpha, y.data_ptr()), "qd_gated")
    return y


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The index of the first largest value of each row of ``x [n, V]``, as ``torch.argmax`` gives it; torch's own
    where the kernel does not take ``x`` (not float32 on CPU, no kernels, a row with a NaN). A vector is one row."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not ( x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
            and x.shape[1] > 0 and available()):
        return x.argmax(dim=-1).tolist()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _check(lib().qd_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr()), "qd_argmax")
    ids = out.tolist()
    return [i if i >= 0 else int(x[r].argmax()) for r, i in enumerate(ids)]


def row_logprobs(x: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...] | None:
    """Per row of ``x [n, V]`` (float32 logits): the ``chosen`` token's logprob and rank, and the ids and logprobs of
    the ``k`` largest (largest first; the lower id first among equal logits), in two passes over the row
    (``qd_row_logprobs``). None where the kernel does not take ``x`` (not float32 rows on the CPU, no kernels); a
    row it leaves to torch (a NaN, an infinite largest logit, no finite one) has rank -1."""
    if not (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
            and x.shape[1] > 0 and (x.stride(0) >= x.shape[1] or x.shape[0] == 1) and 0 <= k <= x.shape[1]
            and chosen.numel() == x.shape[0] and available()):
        return None
    n = x.shape[0]
    chosen = chosen.to(torch.int64).contiguous()
    chosen_lp, rank = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int32)
    top_ids, top_lp = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k, dtype=torch.float32)
    _check(lib().qd_row_logprobs(x.data_ptr(), n, x.shape[1], max(x.stride(0), x.shape[1]), chosen.data_ptr(), k,
                                 chosen_lp.data_ptr(),
                                 rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr()), "qd_row_logprobs")
    return chosen_lp, rank, top_ids, top_lp


def runs_lora(out: torch.Tensor, x: torch.Tensor) -> bool:
    return (_float_kind(out) and _float_kind(x) and out.dim() == x.dim() == 2 and out.stride(1) == x.stride(1) == 1
            and available())


def lora_add(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None, parts: tuple) -> None:
    """``out[rows] += scale B (A x[rows])`` of each LoRA part, in place (``qd_lora_add``: each row's sums in one fixed
    order, so its bits never depend on the batch); ``rows`` (int64) None: every row. ``parts``: (count, offsets,
    ranks, outs, scales, A pointers, transposed-B pointers) as ctypes arrays (``models/lora.py``'s ``SiteCall``)."""
    n = out.shape[0] if rows is None else rows.numel()
    _check(lib().qd_lora_add(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), out.data_ptr(),
                             int(out.dtype == torch.bfloat16), out.stride(0), None if rows is None else rows.data_ptr(),
                             n, x.shape[1], *parts), "qd_lora_add")


def dry_repeats(tokens: np.ndarray, limit: int) -> np.ndarray | None:
    """For each position j < n - 1 of ``tokens`` (int64), the length of the longest run ending at j equal to the run
    ending at the last token, at most ``limit`` (``qd_dry_repeats``, linear time); None without the kernels."""
    if not available():
        return None
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    out = np.empty(max(len(tokens), 1), dtype=np.int32)
    _check(lib().qd_dry_repeats(tokens.ctypes.data, len(tokens), limit, out.ctypes.data), "qd_dry_repeats")
    return out[:max(len(tokens) - 1, 0)]


class _KVCacheDesc(ctypes.Structure):  # qd_kv_cache
    _fields_ = [("k", _P), ("v", _P), ("k_scale", _P), ("v_scale", _P), ("format", _I)]


class _AttnItemsDesc(ctypes.Structure):  # qd_attn_items
    _fields_ = [("rows", _P), ("slots", _P), ("lengths", _P), ("group_first", _P), ("items", _I), ("width", _I),
                ("groups", _I)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class CacheLayer:
    """One layer's keys and values as the pool stores them, ``[slots, kv_heads, head_dim]`` each: float32 or bfloat16
    (the activations' dtype), or int8 with float32 scales ``[slots, kv_heads, head_dim / KV_SCALE_GROUP]``."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def desc(self) -> _KVCacheDesc:
        return _KVCacheDesc(self.k.data_ptr(), self.v.data_ptr(), _ptr(self.k_scale), _ptr(self.v_scale),
                            KV_FORMATS[self.k.dtype])


@dataclass
class AttnItems:
    """The query rows of an attention call (int64 tensors). Item r: query row ``rows[r]`` attends to its first
    ``lengths[r]`` positions, at cache slots ``slots[r, :lengths[r]]``. Items ``group_first[g] ..
    group_first[g + 1] - 1`` are one sequence's consecutive tokens (a verify pass): they read the cache once."""

    rows: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    group_first: torch.Tensor

    def desc(self) -> _AttnItemsDesc:
        return _AttnItemsDesc(self.rows.data_ptr(), self.slots.data_ptr(), self.lengths.data_ptr(),
                              self.group_first.data_ptr(), self.slots.shape[0], self.slots.shape[1],
                              len(self.group_first) - 1)


def attends(head_dim: int, cache: torch.dtype, queries: torch.dtype) -> bool:
    """Whether the attention kernel takes heads of ``head_dim`` with queries of ``queries`` (float32 or bfloat16)
    over a cache of ``cache`` (the queries' own dtype, or int8)."""
    return (queries in (torch.float32, torch.bfloat16) and cache in (queries, torch.int8) and head_dim % 8 == 0
            and head_dim <= MAX_HEAD_DIM and (cache != torch.int8 or head_dim % KV_SCALE_GROUP == 0))


def runs_attend(q: torch.Tensor, cache: CacheLayer) -> bool:
    """q ``[T, H, D]`` on CPU, laid out as the kernel reads it, and a cache it takes (``attends``)."""
    t, heads, d = q.shape
    kv_heads = cache.k.shape[1]
    return (_float_kind(q) and attends(d, cache.k.dtype, q.dtype) and cache.k.device.type == "cpu"
            and q.stride(2) == 1 and q.stride(1) == d and heads % kv_heads == 0 and cache.k.is_contiguous()
            and available())


def attend(q: torch.Tensor, cache: CacheLayer, items: AttnItems, out: torch.Tensor, scale: float, window: int,
           sinks: torch.Tensor | None = None, softcap: float | None = None) -> None:
    """Each item's query row of ``q [T, H, D]`` attends (dot products times ``scale``, softmax in float32) to its
    context in ``cache``, or with ``window`` > 0 to its last ``window`` positions (itself included; 0: all of it), each
    softmax also over its head's logit in ``sinks [H]`` (gpt-oss), each score soft-capped to ``softcap * tanh(s /
    softcap)`` where given (Gemma 2); the result goes to ``out[rows[r]]`` (q's dtype)."""
    _, heads, d = q.shape
    sinks = None if sinks is None else sinks.detach().float().reshape(heads).contiguous()  # (another shape raises)
    _check(lib().qd_attend(q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), heads, cache.k.shape[1], d,
                           ctypes.byref(cache.desc()), ctypes.byref(items.desc()), scale, window, _ptr(sinks),
                           softcap or 0.0, out.data_ptr()), "qd_attend")


def runs_kv_store(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """x ``[T, KVH, D]`` (float32 or bfloat16, rows may be strided) and a CPU cache of x's dtype or int8."""
    return (_float_kind(x) and cache.device.type == "cpu" and cache.dtype in (x.dtype, torch.int8)
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and available())


def kv_store(x: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Writes ``x [T, KVH, D]`` (rows may be strided) to ``cache[slot_mapping]``: copied, or as int8 with one float32
    scale per ``KV_SCALE_GROUP`` values (``scales[slot_mapping]``)."""
    t, kv_heads, d = x.shape
    _check(lib().qd_kv_store(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), t, kv_heads, d,
                             slot_mapping.data_ptr(), cache.data_ptr(), _ptr(scales), KV_FORMATS[cache.dtype]),
           "qd_kv_store")
