"""quickdraft's C kernels for the small per-token operations (models/cpu_ops.c) and fused qmatmul calls: they
agree with torch's operations, and every row's result is bit-identical whatever the other rows of the call
and wherever its buffer lies (speculative verification and batching rely on this)."""
from __future__ import annotations

import math

import hashlib
import logging
import os
import random
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quickdraft.models import native, native_build
from quickdraft.models.quant import Int4Linear, Int8Linear
from quickdraft.models.quant_group import QuantGroup
from quickdraft.models.transformer import RotaryEmbedding

pytestmark = pytest.mark.skipif(not native.available(), reason="quickdraft's CPU kernels not built on this CPU")
DTYPES = [torch.float32, torch.bfloat16]


def _offset_copy(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x`` in a buffer starting ``shift`` elements into a larger one (another alignment)."""
    buf = torch.empty(x.numel() + shift, dtype=x.dtype)
    view = buf[shift:].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_and_rows_are_independent(dtype):
    torch.manual_seed(0)
    x, w = (torch.randn(20, 1536) * 3).to(dtype), torch.randn(1536).to(dtype)
    y = native.rms_norm(x, w, 1e-6)
    ref = F.rms_norm(x.float(), (1536,), w.float(), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    for r in (0, 7, 19):  # one row alone, from a buffer at another offset, as in the batch of 20
        assert torch.equal(native.rms_norm(_offset_copy(x[r:r + 1], 3), w, 1e-6), y[r:r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 48, 0])
def test_rope_matches_torch_and_rows_are_independent(dtype, rotary_dim):
    """Whole heads, the first 48 of 64 dims (partial rotary: the rest pass untouched) and none (a NoPE layer)."""
    torch.manual_seed(1)
    rope = RotaryEmbedding(64, 10000.0, 512, rotary_dim=rotary_dim)
    rope.reach(512)  # tables for every position used below (they grow with the positions a forward reaches)
    qkv = torch.randn(6, 5 * 64).to(dtype)  # 3 query + 2 key heads of a fused projection, rotated in place
    positions = torch.tensor([3, 100, 101, 102, 400, 511])
    heads = qkv.clone().view(6, 5, 64)
    half = rotary_dim // 2
    x1, x2, rest = heads.float().split((half, half, 64 - rotary_dim), dim=-1)
    cos, sin = rope.cos[positions][:, None], rope.sin[positions][:, None]
    ref = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    batch = qkv.clone()
    native.rope_(batch.view(6, 5, 64), positions, rope.cos, rope.sin)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(batch.view(6, 5, 64).float(), ref, rtol=tol, atol=tol * 4)
    assert torch.equal(batch.view(6, 5, 64)[..., rotary_dim:], heads[..., rotary_dim:])
    assert torch.equal(rope(heads.clone(), positions), batch.view(6, 5, 64))  # the module's own call, same bits
    for r in range(6):
        alone = _offset_copy(qkv[r:r + 1], r + 1)
        native.rope_(alone.view(1, 5, 64), positions[r:r + 1], rope.cos, rope.sin)
        assert torch.equal(alone, batch[r:r + 1])


def test_gated_activation_matches_torch():
    """qd_gated, which the module path and the fused layer share, is torch's silu or gelu(tanh) times up."""
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 200) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    for act, ref in (("silu", F.silu(gate) * up), ("gelu_tanh", F.gelu(gate, approximate="tanh") * up)):
        assert torch.allclose(native.gated(gate_up, act), ref, rtol=1e-6, atol=1e-6), act
        got = native.gated(gate_up.bfloat16(), act)
        assert torch.equal(got, native.gated(gate_up.bfloat16().float(), act).bfloat16()), act  # rounded once
        assert torch.equal(native.gated(gate_up[2:3].bfloat16(), act), got[2:3]), act  # a row alone


def test_quant_group_is_its_layers_side_by_side_and_swiglu_is_silu_times_up():
    """q/k/v with mixed formats (a Q4_K_M GGUF stores some v projections with more bits) in one call give each
    layer's own result bit for bit; gate/up with SwiGLU in the kernel match silu(gate) * up."""
    torch.manual_seed(3)
    q, k = Int4Linear.from_float(torch.randn(96, 576), torch.randn(96)), Int4Linear.from_float(torch.randn(32, 576))
    v = Int8Linear.from_float(torch.randn(32, 576), torch.randn(32))
    x = torch.randn(7, 576, dtype=torch.bfloat16)
    fused = QuantGroup([q, k, v])(x)
    assert torch.equal(fused, torch.cat([q(x), k(x), v(x)], dim=-1))
    assert torch.equal(QuantGroup([q, k, v])(x[2:3]), fused[2:3])  # a row alone: the same bits
    gate, up = Int4Linear.from_float(torch.randn(300, 576)), Int4Linear.from_float(torch.randn(300, 576))
    act = QuantGroup([gate, up], swiglu=True)(x.float())
    ref = F.silu(gate(x.float())) * up(x.float())
    assert torch.allclose(act, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="2 of equal size"):
        QuantGroup([q, k], swiglu=True)


def test_bf16_linear_matches_torch_and_rows_are_independent():
    """Odd sizes: K not a multiple of 32 (masked tail), N not a multiple of the column tile, 1..9 rows."""
    torch.manual_seed(4)
    w, bias = torch.randn(37, 1000).to(torch.bfloat16), torch.randn(37)
    x = torch.randn(9, 1000).to(torch.bfloat16)
    y = native.linear_bf16(x, w, bias)
    ref = F.linear(x.float(), w.float(), bias)
    assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    for rows in range(1, 9):
        part = native.linear_bf16(_offset_copy(x[rows - 1:rows - 1 + rows], 1), w, bias)
        assert torch.equal(part, y[rows - 1:rows - 1 + rows])


@pytest.mark.parametrize("out_features", [8, 37, 1000])
def test_weight_streaming_kernels_compute_every_column_once_whatever_the_thread_count(out_features):
    """The threads share a call's column tasks by claiming them (models/tasks.h): with fewer tasks than threads,
    a task count no thread count divides, and more threads than cores, every column is computed, by one thread, to
    the bits one thread gives (an output left unwritten would hold what torch.empty left there)."""
    torch.manual_seed(5)
    k = 576
    q = Int4Linear.from_float(torch.randn(out_features, k), torch.randn(out_features))
    v = Int8Linear.from_float(torch.randn(out_features, k))
    group = QuantGroup([q, v])
    w_bf16 = torch.randn(out_features, k).to(torch.bfloat16)
    before = torch.get_num_threads()
    results: dict[int, list[torch.Tensor]] = {}
    try:
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            for rows in (1, 5):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
                results.setdefault(threads, []).extend([group(x), native.linear_bf16(x, w_bf16)])
    finally:
        torch.set_num_threads(before)
    for threads, outs in results.items():
        for got, alone in zip(outs, results[1]):
            assert torch.equal(got, alone), f"{threads} threads differ from one"
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = F.linear(x.float(), w_bf16.float())
    assert torch.allclose(results[1][3].float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    assert torch.equal(results[1][2], torch.cat([q(x), v(x)], dim=-1))


# ---- the build cache: damaged libraries, the temporary build path, a compiler that hangs -------------------------
@pytest.fixture
def fresh_loader(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """The loader as in a new process with an empty private cache; returns the cache and the library in use."""
    in_use = Path(native.lib()._name)
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    return tmp_path / "cache", in_use


DAMAGE = {  # the cached file, the checksum beside it (of the good library, none, or of the file), the warning
    "truncated": (lambda good: good[:len(good) // 2], "good", "does not match the checksum recorded when it was built"),
    "bit flip": (lambda good: good[:5000] + bytes([good[5000] ^ 1]) + good[5001:], "good",
                 "does not match the checksum"),
    "no checksum": (lambda good: good, None, "has no recorded checksum"),
    "not a library, checksum recomputed": (lambda good: random.Random(0).randbytes(4096), "file", "does not load"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cached_library_is_rebuilt_once(fresh_loader, monkeypatch, caplog, damage):
    """A truncated library would crash the process in dlopen (SIGBUS), so the recorded checksum is checked first."""
    cache, in_use = fresh_loader
    target = native_build.library_path(native_build.find_compiler())
    assert target.parent == cache / "kernels"
    target.parent.mkdir(parents=True)
    make, checksum_of, message = DAMAGE[damage]
    good = in_use.read_bytes()
    target.write_bytes(make(good))
    if checksum_of is not None:
        summed = good if checksum_of == "good" else target.read_bytes()
        native_build.checksum_path(target).write_text(hashlib.sha256(summed).hexdigest())
    outputs = []
    run = native_build.run
    monkeypatch.setattr(native_build, "run", lambda cmd: (outputs.append(Path(cmd[cmd.index("-o") + 1]))
                                                     if "-o" in cmd else None) or run(cmd))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.available(), native.unavailable_reason()
    assert f"{target} {message}" in caplog.text and "rebuilding it" in caplog.text
    assert native.lib()._name == str(target)
    assert native_build.checksum_path(target).read_text() == hashlib.sha256(target.read_bytes()).hexdigest()
    # built under a fresh private directory with a random name beside the target (its objects, qmatmul.c's in
    # parts, then the library), then renamed over it
    (built,) = [path for path in outputs if path.suffix != ".o"]
    assert built.name == target.name and built.parent.parent == target.parent
    assert built.parent.name.startswith(".build-") and built.parent.name != ".build-"
    assert {path.parent for path in outputs} == {built.parent} and not built.parent.exists()
    assert {path.name for path in outputs} > {"cpu_ops.o", "qmatmul-0.o", "qmatmul-1.o"}
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, f"{target.stem}.sha256"])
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.allclose(native.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_whether_the_kernels_can_be_built_is_answered_without_building_them(fresh_loader, monkeypatch):
    """What `quickdraft models` plans with: nothing is compiled or cached to answer it."""
    cache, _ = fresh_loader
    assert native.can_build() and not cache.exists()
    flags = native.cpu_flags
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # no F16C: qmatmul.c's #error
    assert not native.can_build()
    monkeypatch.setattr(native, "cpu_flags", flags)
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert not native.can_build() and not cache.exists()


def test_a_failed_compile_stops_the_build_and_says_why(fresh_loader, tmp_path, monkeypatch):
    """The objects compile side by side: the first failure's message is the reason given, no compile starts after
    it (at most one a core ran), nothing is linked, and the build directory is gone."""
    cache, _ = fresh_loader
    cc = tmp_path / "broken-cc"
    cc.write_text(f'#!/bin/sh\ncase "$1" in --version) exec {native_build.find_compiler()} --version;; esac\n'
                  'echo "broken-cc: cannot compile $*" >&2; exit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    ran = []
    run = native_build.run
    monkeypatch.setattr(native_build, "run", lambda cmd: ran.append(cmd) or run(cmd))
    assert not native.available()
    assert native.unavailable_reason().startswith(f"RuntimeError: {cc} failed: broken-cc: cannot compile ")
    compiles = [cmd for cmd in ran if "-c" in cmd]
    assert compiles and len(compiles) == len(ran) - 1  # (and the --version of the cache's key)
    assert len(compiles) <= len(os.sched_getaffinity(0))
    assert list((cache / "kernels").iterdir()) == []


def test_a_compiler_that_hangs_is_killed_and_torch_ops_are_used(fresh_loader, tmp_path, monkeypatch, caplog):
    """The fake compiler answers --version, then hangs in a child process (as cc1 or ld would): the whole process
    group is killed at the time limit and the kernels are reported unavailable with a warning."""
    cache, _ = fresh_loader
    pid_file = tmp_path / "child.pid"
    cc = tmp_path / "slow-cc"
    cc.write_text(f'#!/bin/sh\ncase "$1" in --version) echo "slow-cc 1.0";; *) sleep 120 & echo $! > {pid_file}; '
                  f'wait;; esac\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native_build, "COMPILE_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not native.available()
    assert time.monotonic() - start < 30
    assert native.unavailable_reason() == f"{cc} did not finish within 1 s (COMPILE_TIMEOUT_S)"
    assert "using torch's operations" in caplog.text
    assert not native.runs_rms_norm(torch.randn(2, 64), torch.randn(64))  # the model takes torch's path
    assert list((cache / "kernels").iterdir()) == []  # the build directory was removed
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the compiler's child was killed too (and reaped by init)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the compiler's child process {child} is still running")


def test_row_logprobs_equal_float64_log_softmax_on_ties_infinities_nans_and_tails():
    """Each row's chosen logprob and rank, and its top k, against a float64 reading of the definition: within float32
    rounding, ranks exact, the top k in order of logit, the lower id first among equal logits; a row with a NaN or no
    finite logit is left to torch (sampler.top_logprobs asks it), and top_logprobs' results are the same either way."""
    from quickdraft.sampling import sampler
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 151936, generator=gen) * 4
    wide[1, 1000:5000] = float("-inf")  # masked columns
    wide[2, [7, 77777, 151935]] = wide[2].max() + 1  # three-way tie at the top, one in the tail
    rows = torch.cat([wide[:, :1003], torch.randn(6, 1003, generator=gen)])  # not a multiple of 8 wide
    for x in (wide, rows, wide[:, :1000]):  # the last: rows further apart than they are wide
        chosen = torch.randint(0, x.shape[1], (x.shape[0],), generator=gen)
        chosen[2] = 7
        for k in (0, 1, 3, 20):
            lp, rank, ids, top = native.row_logprobs(x, chosen, k)
            want = torch.log_softmax(x.double(), -1)
            assert torch.allclose(lp.double(), want.gather(-1, chosen[:, None]).squeeze(1), atol=5e-5, rtol=0)
            assert rank.tolist() == (1 + (x > x.gather(-1, chosen[:, None])).sum(-1)).tolist()
            for r in range(x.shape[0]):
                order = torch.sort(-x[r], stable=True).indices[:k].tolist()  # (stable: the lower id first)
                assert ids[r].tolist() == order
                assert torch.allclose(top[r].double(), want[r, order], atol=5e-5, rtol=0)
    odd = torch.randn(4, 50, generator=gen)
    odd[0, 9] = float("nan")
    odd[1] = float("-inf")
    odd[3, 5] = float("inf")
    chosen = torch.tensor([1, 2, 3, 4])
    assert native.row_logprobs(odd, chosen, 2)[1].tolist()[:2] + native.row_logprobs(odd, chosen, 2)[1].tolist()[3:] \
        == [-1, -1, -1]
    confident = torch.full((1, 1000), -60.0)
    confident[0, [3, 4]] = torch.tensor([40.0, 24.0])  # the top token's logprob is -1.1e-7: below half a float step
    lp, *_ = native.row_logprobs(confident, torch.tensor([3]), 1)  # at 40, so 40 + log(sum) would round it to 0
    assert lp.item() < 0 and lp.item() == pytest.approx(-math.exp(-16), rel=0.05)
    assert native.row_logprobs(torch.randn(1, 64).expand(3, 64), torch.tensor([1, 2, 3]), 1) is None  # 0 apart
    fast = sampler.top_logprobs(odd, chosen, 2)
    slow = sampler._torch_logprobs(odd, chosen, 2)
    assert fast[2]["logprob"] == pytest.approx(slow[0][2].item(), abs=1e-5) and fast[1]["rank"] == slow[1][1].item()
    assert math.isnan(fast[0]["logprob"])


def test_argmax_rows_equals_torch_argmax_on_ties_infinities_nans_and_tails():
    """The greedy token is the first index of the largest value, exactly as torch.argmax picks it."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(151936, generator=gen), torch.randn(49157, generator=gen), torch.full((13,), float("-inf")),
            torch.tensor([0.0, -0.0, 0.0, -1.0]), torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0, 3.0]),
            torch.tensor([float("nan"), 1.0, 2.0]), torch.tensor([1.0, 2.0, float("nan")] * 5)]
    tied = torch.randn(100, generator=gen)
    tied[[17, 64, 97]] = tied.max() + 1  # in a vector block, in another, in the tail
    rows.append(tied)
    for row in rows:
        x = row.reshape(1, -1)
        assert native.argmax_rows(x) == x.argmax(dim=-1).tolist(), row[:8]
    batch = torch.randn(5, 1000, generator=gen)
    batch[2, 500:] = batch[2].max() + 2  # many ties: the first one
    assert native.argmax_rows(batch) == batch.argmax(dim=-1).tolist()
    wide = torch.randn(3, 1024, generator=gen)
    assert native.argmax_rows(wide[:, :1000]) == wide[:, :1000].argmax(dim=-1).tolist()  # rows 1024 apart
