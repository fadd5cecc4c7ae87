"""The paged KV cache's storage: every layer's keys and values for one model, in the format the user chose.

``kv_cache_dtype``: ``auto`` (the activations' dtype: exact), or ``int8`` with one float32 scale per
``SCALE_GROUP`` values (as llama.cpp's q8_0 cache; vLLM's fp8 cache plays the same part): each token stores and
each decode step reads 0.56x the bytes of bfloat16, at a small, measured cost in agreement (docs/MEASUREMENTS.md).
The attention kernel reads either format in place; torch's paths (prompt pieces, other devices) read a dequantized
copy of the slots they need.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import platform
import sys

import torch

from quickdraft.errors import InvalidParameterError
from quickdraft.loading.tensor_file import drop_pages
from quickdraft.models import native, triton_ops

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")
SCALE_GROUP = native.KV_SCALE_GROUP

# not accounted against the machine's memory up front (pages are committed as written); Python < 3.12 has no name
# for the flag, whose value is 0x4000 on Linux's x86, Arm and RISC-V (other architectures reserve without it)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") and platform.machine()
                        in ("x86_64", "i686", "aarch64", "armv7l", "riscv64") else 0)


def check_kv_cache_dtype(name: object) -> None:
    if name not in KV_CACHE_DTYPES:
        raise InvalidParameterError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def resolve_kv_cache_dtype(name: str, activations: torch.dtype, head_dim: int) -> torch.dtype:
    """The cache dtype for ``kv_cache_dtype=name`` beside a model computing in ``activations``."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return activations
    if name == "int8":
        if head_dim % SCALE_GROUP:
            raise InvalidParameterError(f"kv_cache_dtype='int8' needs a head_dim divisible by {SCALE_GROUP}; this "
                                        f"model's is {head_dim}: use 'auto'")
        return torch.int8
    dtype = getattr(torch, name)
    if dtype != activations:
        raise InvalidParameterError(f"kv_cache_dtype={name!r} needs a model computing in {name}, this one computes in "
                                    f"{str(activations).removeprefix('torch.')}: use 'auto' or 'int8'")
    return dtype


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` as int8 values and float32 scales ``[..., D / SCALE_GROUP]``: scale = max |x| / 127 per group,
    value = x / scale rounded to nearest even. The same bytes as the C kernel's ``qd_kv_store``."""
    groups = x.float().unflatten(-1, (-1, SCALE_GROUP))
    amax = groups.abs().amax(-1)
    scale = amax / amax.new_tensor(127.0)  # (a tensor: CUDA divides by a Python number as a reciprocal's product)
    values = torch.where(scale[..., None] > 0, torch.round(groups / scale[..., None]), 0)
    return values.to(torch.int8).flatten(-2), scale


def dequantize_int8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float().unflatten(-1, (-1, SCALE_GROUP)) * scale[..., None]).flatten(-2).to(dtype)


class KVPool:
    """Keys and values for every layer of one model: ``[layers, blocks * block_size, kv_heads, head_dim]`` each, of
    ``dtype`` (a float dtype, or int8 beside float32 ``k_scale``/``v_scale`` ``[.., head_dim / SCALE_GROUP]``).

    On CPU the storage is reserved, not filled: an anonymous mapping whose pages take memory when a block is first
    written, so a pool sized for the longest contexts costs what the sequences actually hold; ``release_from`` hands
    the pages of unused blocks back. Other devices allocate the whole pool up front."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs at least one block of at least one slot, got {num_blocks}x{block_size}")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.quantized = dtype == torch.int8
        self._maps: list[tuple[mmap.mmap, torch.Tensor]] = []
        mapped = torch.device(device).type == "cpu" and hasattr(mmap, "MAP_ANONYMOUS")
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        shapes = {"k": (shape, dtype), "v": (shape, dtype)}
        if self.quantized:
            scales = (*shape[:3], head_dim // SCALE_GROUP)
            shapes |= {"k_scale": (scales, torch.float32), "v_scale": (scales, torch.float32)}
        self.planes: dict[str, torch.Tensor] = {
            name: self._reserve(s, t) if mapped else torch.zeros(s, dtype=t, device=device)
            for name, (s, t) in shapes.items()}
        self.k, self.v = self.planes["k"], self.planes["v"]
        self.k_scale, self.v_scale = self.planes.get("k_scale"), self.planes.get("v_scale")

    def _reserve(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        with contextlib.suppress(AttributeError, OSError):
            # a layer's next block is a few KiB: with transparent huge pages its first write would commit 2 MiB
            mapping.madvise(mmap.MADV_NOHUGEPAGE)
        tensor = torch.frombuffer(mapping, dtype=dtype).view(shape)
        self._maps.append((mapping, tensor))
        return tensor

    def layer(self, i: int) -> native.CacheLayer:
        return native.CacheLayer(self.k[i], self.v[i], None if self.k_scale is None else self.k_scale[i],
                                 None if self.v_scale is None else self.v_scale[i])

    @property
    def scale_layer_stride(self) -> int:
        return 0 if self.k_scale is None else self.k_scale.stride(0)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new keys and values ``[T, kv_heads, head_dim]`` (the activations' dtype) at ``slot_mapping``."""
        if not self.quantized:
            keys, values = self.k[layer], self.v[layer]
            if triton_ops.runs_kv_write(k, keys) and triton_ops.runs_kv_write(v, values):
                triton_ops.kv_write(k, v, slot_mapping, keys, values)  # one kernel on a GPU, not two
                return
            keys.index_copy_(0, slot_mapping, k)
            values.index_copy_(0, slot_mapping, v)
            return
        for x, values, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            if native.runs_kv_store(x, values):
                native.kv_store(x, slot_mapping, values, scales)
            else:
                q, s = quantize_int8(x)
                values.index_copy_(0, slot_mapping, q)
                scales.index_copy_(0, slot_mapping, s)

    def write_rotated(self, layer: int, slot_mapping: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate q in place and store k rotated, with v, at ``slot_mapping``, in one kernel where it runs (a float
        cache on a GPU, RoPE over whole heads): True; else False, nothing done (the caller rotates, then ``write``s)."""
        if (self.quantized or 2 * cos.shape[1] != q.shape[-1]
                or not triton_ops.runs_rope_kv_write(q, k, v, self.k[layer])):
            return False
        triton_ops.rope_kv_write(q, k, v, positions, cos, sin, slot_mapping, self.k[layer], self.v[layer])
        return True

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (any shape S), as ``dtype``: ``[*S, kv_heads, head_dim]`` each."""
        k, v = self.k[layer][slots], self.v[layer][slots]
        if self.quantized:
            return (dequantize_int8(k, self.k_scale[layer][slots], dtype),
                    dequantize_int8(v, self.v_scale[layer][slots], dtype))
        return k.to(dtype), v.to(dtype)

    def release_from(self, block: int) -> None:
        """Give the memory of blocks ``block`` and up back to the system (they read as zeros when next used)."""
        if not self._maps or block >= self.num_blocks:
            return
        for mapping, tensor in self._maps:
            if block == 0:  # everything, the pages that straddle two layers included
                mapping.madvise(mmap.MADV_DONTNEED)
                continue
            layers, slots = tensor.shape[:2]
            layer_bytes = tensor[0].numel() * tensor.element_size()
            start_in_layer = block * self.block_size * layer_bytes // slots
            for layer in range(layers):
                drop_pages(mapping, layer * layer_bytes + start_in_layer, (layer + 1) * layer_bytes)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for plane in self.planes.values():
            plane[:, dst * bs:(dst + 1) * bs] = plane[:, src * bs:(src + 1) * bs]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        values = 2 * num_layers * block_size * num_kv_heads * head_dim
        if dtype == torch.int8:
            return values + values // SCALE_GROUP * 4
        return values * dtype.itemsize
