"""The CPU kernel for weight-only quantized linear layers (``qmatmul.c``): build, load, lay out, call.

Why a kernel of our own: torch's packed CPU kernels (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) stream a decode step's weights at well under half the memory bandwidth of a
2-core AVX512 machine, and their cost grows ~3x from 1 to 5 rows, which is what makes speculative
verification expensive with quantized weights. ``qmatmul.c`` quantizes the activations to int8 per group of
32 and multiplies with VNNI int8 dot products (as llama.cpp does), one weight block unpacked once for up to
4 rows, and computes every row independently of the others (bit-identical whatever the batch).

It is compiled on first use with the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``)
into ``cache_root()/kernels/`` and linked against the OpenMP runtime torch already loaded, so it shares
torch's threads and ``torch.set_num_threads``. Where it cannot be built (no compiler, a CPU without AVX-VNNI
/ AVX512-VNNI) ``available()`` is False and the layers use torch's kernels; ``QUICKDRAFT_QMATMUL=0`` turns
it off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from quickdraft.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
BLOCK = 256  # input columns per block (8 groups)
GROUP = 32
DISABLE_ENV = "QUICKDRAFT_QMATMUL"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cpu_identity() -> str:
    """Model name and feature flags: a kernel built with -march=native is only reused on the same CPU type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = "\n".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), _cpu_identity()])
    target = cache_root() / "kernels" / f"qmatmul-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-400:]}")
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        if os.environ.get(DISABLE_ENV, "1") == "0":
            _error = f"turned off by {DISABLE_ENV}=0"
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if platform.machine().lower() not in ("x86_64", "amd64") or compiler is None:
            _error = "needs an x86-64 CPU and a C compiler"
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except Exception as exc:  # no VNNI (#error in the source), compiler missing headers, ...
            _error = f"{type(exc).__name__}: {exc}"
            log.info("qmatmul kernel unavailable, using torch's kernels (%s)", _error)
            return None
        fn = lib.qd_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        _lib = lib
        return _lib


def available() -> bool:
    """True when the kernel is built (or was just built) and loaded for this CPU."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def padded_width(in_features: int) -> int:
    return -(-in_features // BLOCK) * BLOCK


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of ``w[n, k] = scales[n, k // 32] * (q[n, k] - off) + zeros[n, k // 32]``.

    ``q``: ``[N, K]`` unsigned values (0..15 for ``bits=4`` with off 8, 0..255 for ``bits=8`` with off 128);
    ``scales``/``zeros``: ``[N, K // 32]`` (rounded to bfloat16). Returns ``(weight uint8 [N, Kpad * bits / 8],
    scales_zeros bfloat16 [N, Kpad / 256, 16])``; padded columns have scale and zero 0."""
    n, k = q.shape
    if bits not in (4, 8) or k % GROUP or scales.shape != (n, k // GROUP) or zeros.shape != scales.shape:
        raise ValueError(f"qmatmul.pack: need bits 4/8, K % {GROUP} == 0 and [N, K/{GROUP}] scales; got bits={bits}, "
                         f"q {tuple(q.shape)}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    kpad = padded_width(k)
    nblk = kpad // BLOCK
    qp = torch.zeros(n, kpad, dtype=torch.uint8)
    qp[:, :k] = q.to(torch.uint8)
    # element 32 j + 4 t + i of a block -> byte 32 t + 4 j + i
    arranged = qp.reshape(n, nblk, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nblk, 8, 32)
    if bits == 4:
        weight = (arranged[:, :, 0::2] | (arranged[:, :, 1::2] << 4)).reshape(n, kpad // 2)
    else:
        weight = arranged.reshape(n, kpad)
    sz = torch.zeros(n, kpad // GROUP, 2, dtype=torch.bfloat16)
    sz[:, :k // GROUP, 0] = scales.to(torch.bfloat16)
    sz[:, :k // GROUP, 1] = zeros.to(torch.bfloat16)
    sz = sz.reshape(n, nblk, 8, 2).transpose(2, 3).reshape(n, nblk, 16)
    return weight.contiguous(), sz.contiguous()


def unpack(weight: torch.Tensor, scales_zeros: torch.Tensor, bits: int, in_features: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: ``(q uint8 [N, K], scales, zeros bfloat16 [N, K // 32])``."""
    n = weight.shape[0]
    kpad = padded_width(in_features)
    nblk = kpad // BLOCK
    if bits == 4:
        packed = weight.reshape(n, nblk, 4, 32)
        arranged = torch.stack((packed & 0x0F, packed >> 4), dim=3).reshape(n, nblk, 8, 32)
    else:
        arranged = weight.reshape(n, nblk, 8, 32)
    q = arranged.reshape(n, nblk, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, kpad)[:, :in_features]
    sz = scales_zeros.reshape(n, nblk, 2, 8).transpose(2, 3).reshape(n, kpad // GROUP, 2)[:, :in_features // GROUP]
    return q.contiguous(), sz[..., 0].contiguous(), sz[..., 1].contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, bits: int, in_features: int,
           out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (float32 or bfloat16) times the packed weight: ``[M, N]`` in ``x``'s dtype."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"qmatmul kernel unavailable: {_error}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype)
    rc = lib.qd_linear(x.data_ptr(), int(x.dtype == torch.bfloat16), m, in_features, weight.data_ptr(),
                       scales_zeros.data_ptr(), bits, out_features, padded_width(in_features),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), int(y.dtype == torch.bfloat16))
    if rc != 0:
        raise RuntimeError(f"qd_linear failed ({'out of memory' if rc == -1 else 'bad arguments'}, code {rc})")
    return y
