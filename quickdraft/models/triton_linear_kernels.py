"""The Triton kernels behind ``triton_linear``: the weight-only matmul and the adder of its chunks' sums.

Kept apart from the layers that call them. Triton is imported and the kernels are defined on first use
(``kernels()``), so a CPU process never imports Triton; the helpers the kernels call are module globals, which is
where Triton's interpreter looks for them.

``NORM``: the projection's input is ``rms_norm(x + residual)`` (a decoder layer's residual add and the norm before
its q/k/v or gate/up projection), computed inside the matmul instead of by a kernel of its own: one launch a
projection fewer. Every program reads its rows' ``x`` and ``residual`` tile by tile as it goes through K, rounds
``s = x + residual`` to x's dtype (the first column of programs writes ``s`` out: the residual stream's next value),
multiplies it by the norm's weight and rounds again, and sums ``s * s`` beside the products. A row's reciprocal RMS
is a factor of every one of its outputs, so it multiplies the finished sums once K is done: no pass over K before
the products. A row's bits do not depend on the rows beside it. Only a shape that no row count splits takes a norm
(``triton_linear.takes_norm``): the launch it saves is what matters where K is short (a small model's projections),
a split K's programs would each need the whole row's squares, and the norm's bits inside the kernel differ from its
own kernel's, so the choice must not follow the rows.
"""
from __future__ import annotations

import functools

triton = tl = None  # optional (pip install triton): imported by kernels(), on first use
_sums = _k_tile = _x_tile = _int4_tile = _dot = _finished = _gated = _chunk_total = None  # the kernels' helpers

# NORM's values (literals in the kernels, which read no module constant): 0 no norm; 1 the norm, the first column of
# programs writing the residual sum of the rows it reads; 2 the norm alone (a gate/up kernel's second pass over K,
# for the up half: the first wrote the sum)


@functools.cache
def kernels():
    """``(weight_only_matmul, add_chunks)``, defined on first use."""
    _helpers()

    @triton.jit
    def weight_only_matmul(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, chunks_per_program,
                           r_ptr, nw_ptr, sum_ptr, eps,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, CHUNK_TILES: tl.constexpr, EVEN_K: tl.constexpr,
                           FINAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_BF16: tl.constexpr, GATE: tl.constexpr,
                           NORM: tl.constexpr):
        """Rows ``rm`` by columns ``rn`` of the output, summed over ``chunks_per_program`` chunks of K from the
        program's third index on: the whole of K into ``out [M, N]`` (``FINAL``: int8's row scales and the bias
        applied, rounded to out's dtype; ``GATE`` >= 0, an activation of ``ACTIVATIONS``: ``out [M, N // 2]``, the
        gated product of the weight's two halves, each rounded first), or one chunk's float32 sum into its slice of
        ``out [chunks, M, N]``. ``NORM`` (``FINAL`` only): x is ``rms_norm(x + r)`` with weight ``nw`` and
        ``eps``, ``x + r`` written to ``sum [M, K]``. ``EVEN_K``: K is a multiple of ``BLOCK_K * CHUNK_TILES``."""
        # int64 offsets: a weight of more than 2^31 values (a 256k vocabulary's head) must not wrap
        rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        chunk = tl.program_id(2) * chunks_per_program
        writes = tl.program_id(0) == 0  # the first column of programs writes the residual sum of its rows' tiles
        total, squares = _sums(x_ptr, w_ptr, s_ptr, rm, rn, chunk, chunks_per_program, M, N, K, stride_xm, r_ptr,
                               nw_ptr, sum_ptr, writes, BITS, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_TILES,
                               EVEN_K, DOT_BF16, NORM)
        width = N
        if FINAL:
            if NORM != 0:
                inverse = 1.0 / tl.sqrt(squares / K + eps)
                total = total * inverse[:, None]
            total = _finished(total, s_ptr, b_ptr, rn[None, :], N, BITS, HAS_BIAS)
            if GATE >= 0:  # the up projection's rows are the weight's second half
                width = N // 2
                up, _ = _sums(x_ptr, w_ptr, s_ptr, rm, rn + width, chunk, chunks_per_program, M, N, K, stride_xm,
                              r_ptr, nw_ptr, sum_ptr, writes, BITS, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_TILES,
                              EVEN_K, DOT_BF16, 2 if NORM != 0 else 0)
                if NORM != 0:
                    up = up * inverse[:, None]
                up = _finished(up, s_ptr, b_ptr, rn[None, :] + width, N, BITS, HAS_BIAS)
                total = _gated(total.to(out_ptr.dtype.element_ty).to(tl.float32),
                               up.to(out_ptr.dtype.element_ty).to(tl.float32), GATE)
        at = out_ptr + tl.program_id(2).to(tl.int64) * M * N  # this chunk's slice (the first, and only, where not split)
        tl.store(at + rm[:, None] * width + rn[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < width))

    @triton.jit
    def add_chunks(sums_ptr, s_ptr, b_ptr, out_ptr, size, chunk_size, N, chunks, BITS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GATE: tl.constexpr, BLOCK: tl.constexpr):
        """``out`` (``size`` values) from the chunks' sums ``[chunks, M, N]`` (``chunk_size`` = M N): each column's
        sums added in order (``_chunk_total``), as ``weight_only_matmul`` adds them in one program, then ``_finished``,
        then, for a ``GATE``, the gated product of the two halves' columns, each rounded to out's dtype first."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = at < size
        if GATE >= 0:
            half = N // 2
            first, col = at // half * N + at % half, at % half
            gate = _finished(_chunk_total(sums_ptr + first, inside, chunk_size, chunks, BLOCK), s_ptr, b_ptr, col, N,
                             BITS, HAS_BIAS)
            up = _finished(_chunk_total(sums_ptr + first + half, inside, chunk_size, chunks, BLOCK), s_ptr, b_ptr,
                           col + half, N, BITS, HAS_BIAS)
            total = _gated(gate.to(out_ptr.dtype.element_ty).to(tl.float32),
                           up.to(out_ptr.dtype.element_ty).to(tl.float32), GATE)
        else:
            total = _finished(_chunk_total(sums_ptr + at, inside, chunk_size, chunks, BLOCK), s_ptr, b_ptr, at % N,
                              N, BITS, HAS_BIAS)
        tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=inside)

    return weight_only_matmul, add_chunks


@functools.cache
def _helpers() -> None:
    """Triton imported and the functions the kernels call defined, as module globals: where Triton's interpreter
    looks for them."""
    global triton, tl, _sums, _finished, _gated, _chunk_total
    import triton
    import triton.language as tl
    _tile_helpers()

    @triton.jit
    def _sums(x_ptr, w_ptr, s_ptr, rm, rn, chunk, chunks, M, N, K, stride_xm, r_ptr, nw_ptr, sum_ptr, writes,
              BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, CHUNK_TILES: tl.constexpr, EVEN_K: tl.constexpr, DOT_BF16: tl.constexpr,
              NORM: tl.constexpr):
        """The float32 sums of rows ``rm`` by weight rows ``rn`` over ``chunks`` chunks of K from ``chunk`` on,
        each chunk summed from zero and added in order; and (``NORM``) the rows' sums of squares of ``x + r`` over
        the same columns, in the same order."""
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        done = 0
        while done < chunks:  # (a while loop: the interpreter cannot take range() over a runtime bound)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # squares summed value by value over the chunk's tiles, then over the row: one reduction a chunk
            chunk_squares = tl.zeros((BLOCK_M, BLOCK_K if BITS >= 8 else BLOCK_K // 2), dtype=tl.float32)
            for tile in tl.static_range(CHUNK_TILES):
                k0 = (chunk + done) * CHUNK_TILES * BLOCK_K + tile * BLOCK_K
                # EVEN_K: every chunk is whole. Otherwise the tiles past K of the last chunk (SmolLM2's 576 columns
                # leave 3.5 of its second chunk's 4 tiles empty) would add only masked zeros: skipped, the same sums
                if EVEN_K:
                    acc, chunk_squares = _k_tile(x_ptr, w_ptr, s_ptr, acc, chunk_squares, rm, rn, k0, M, N, K,
                                                 stride_xm, r_ptr, nw_ptr, sum_ptr, writes, BITS, GROUP, BLOCK_N,
                                                 BLOCK_K, DOT_BF16, NORM)
                elif k0 < K:
                    acc, chunk_squares = _k_tile(x_ptr, w_ptr, s_ptr, acc, chunk_squares, rm, rn, k0, M, N, K,
                                                 stride_xm, r_ptr, nw_ptr, sum_ptr, writes, BITS, GROUP, BLOCK_N,
                                                 BLOCK_K, DOT_BF16, NORM)
            total += acc
            if NORM != 0:
                squares += tl.sum(chunk_squares, axis=1)
            done += 1
        return total, squares

    @triton.jit
    def _finished(total, s_ptr, b_ptr, cols, N, BITS: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Float32 sums of output columns ``cols`` times int8's row scales, plus the bias."""
        if BITS == 8:
            total = total * tl.load(s_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if HAS_BIAS:
            total = total + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        return total

    @triton.jit
    def _gated(gate, up, ACT: tl.constexpr):
        """``act(gate) * up`` in float32: SiLU (``ACT`` 0) or GELU with tanh's approximation (1)."""
        if ACT == 0:  # silu: gate * sigmoid(gate)
            a = gate
        else:  # gelu with tanh's approximation, 0.5 gate (1 + tanh(z)) = gate * sigmoid(2z)
            a = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-tl.abs(a))  # sigmoid without overflow: exp of a value <= 0 only
        return gate * tl.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up

    @triton.jit
    def _chunk_total(sums, inside, chunk_size, chunks, BLOCK: tl.constexpr):
        """The chunks' sums added in order, from the first (a sum of a chunk is never -0.0, as it starts from +0.0;
        a value of cuBLAS's, ``gate_rows``', may be, and keeps its sign)."""
        total = tl.load(sums, mask=inside, other=0.0).to(tl.float32)
        chunk = 1  # stepped a chunk at a time: chunks * chunk_size may pass 2^31 where a caller forces the split
        while chunk < chunks:
            sums += chunk_size
            total += tl.load(sums, mask=inside, other=0.0).to(tl.float32)
            chunk += 1
        return total


@functools.cache
def _tile_helpers() -> None:
    """The helpers that read a tile of the matmul's input and of its weight (module globals, as ``_helpers``'; Triton
    imported by it)."""
    global _k_tile, _x_tile, _int4_tile, _dot

    @triton.jit
    def _k_tile(x_ptr, w_ptr, s_ptr, acc, chunk_squares, rm, rn, k0, M, N, K, stride_xm, r_ptr, nw_ptr, sum_ptr,
                writes, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_BF16: tl.constexpr, NORM: tl.constexpr):
        """``acc`` plus the products of the tile of K from ``k0``, and (``NORM``) ``chunk_squares`` plus its input's
        squares."""
        if BITS >= 8:  # int8, or bfloat16 (BITS 16): a tile of the weight as it is stored
            rk = k0 + tl.arange(0, BLOCK_K)
            x, tile_squares = _x_tile(x_ptr, r_ptr, nw_ptr, sum_ptr, writes, rm, rk, M, K, stride_xm, NORM)
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rk[:, None] < K) & (rn[None, :] < N),
                        other=0)  # the tile [BLOCK_K, BLOCK_N], transposed
            acc = _dot(x, w.to(tl.float32), acc, DOT_BF16)
        else:
            acc, tile_squares = _int4_tile(x_ptr, w_ptr, s_ptr, acc, rm, rn, k0, M, N, K, stride_xm, r_ptr, nw_ptr,
                                           sum_ptr, writes, GROUP, BLOCK_N, BLOCK_K, DOT_BF16, NORM)
        if NORM != 0:
            chunk_squares += tile_squares
        return acc, chunk_squares

    @triton.jit
    def _x_tile(x_ptr, r_ptr, nw_ptr, sum_ptr, writes, rm, rk, M, K, stride_xm, NORM: tl.constexpr):
        """Rows ``rm`` by columns ``rk`` of the matmul's input, and the squares of ``s = x + r`` there (zeros without
        ``NORM``). ``NORM``: the input is ``s`` (rounded to x's dtype, written to ``sum`` where ``writes`` and NORM
        is 1) times the norm's weight, rounded again."""
        inside = (rm[:, None] < M) & (rk[None, :] < K)
        at = rm[:, None] * stride_xm + rk[None, :]
        x = tl.load(x_ptr + at, mask=inside, other=0.0)
        if NORM == 0:
            return x, tl.zeros(x.shape, dtype=tl.float32)
        total = (x.to(tl.float32) + tl.load(r_ptr + at, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
        if NORM == 1:
            tl.store(sum_ptr + at, total, mask=inside & writes)
        total = total.to(tl.float32)
        weight = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        return (total * weight[None, :]).to(x.dtype), total * total

    @triton.jit
    def _int4_tile(x_ptr, w_ptr, s_ptr, acc, rm, rn, k0, M, N, K, stride_xm, r_ptr, nw_ptr, sum_ptr, writes,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_BF16: tl.constexpr, NORM: tl.constexpr):
        """``acc`` plus the tile of K from ``k0``, and the sums of squares of its input's columns (``_x_tile``):
        each byte of the weight is read once, its low nibbles (even columns) and high ones (odd) widened apart and
        met with x's even and odd columns; the tile's groups' scales and zeros are read once each, as a
        [groups, 1, BLOCK_N] block."""
        g = tl.arange(0, BLOCK_K // GROUP)[:, None, None]
        pair = g * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :, None]  # the byte's place in the tile
        inside = (pair < (K - k0) // 2) & (rn[None, None, :] < N)  # (K even: the same bytes as k0 + 2 pair < K,
        # a mask of unit stride, which compiles to vector loads)
        packed = tl.load(w_ptr + rn[None, None, :] * (K // 2) + k0 // 2 + pair, mask=inside, other=0).to(tl.int32)
        at = ((k0 // GROUP + g) * N + rn[None, None, :]) * 2
        group_inside = (k0 + g * GROUP < K) & (rn[None, None, :] < N)
        scale = tl.load(s_ptr + at, mask=group_inside, other=0.0).to(tl.float32)
        zero = tl.load(s_ptr + at + 1, mask=group_inside, other=0.0).to(tl.float32)
        low = tl.reshape(((packed & 0xF).to(tl.float32) - 8.0) * scale + zero, (BLOCK_K // 2, BLOCK_N))
        high = tl.reshape(((packed >> 4).to(tl.float32) - 8.0) * scale + zero, (BLOCK_K // 2, BLOCK_N))
        even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        x_even, even_squares = _x_tile(x_ptr, r_ptr, nw_ptr, sum_ptr, writes, rm, even, M, K, stride_xm, NORM)
        x_odd, odd_squares = _x_tile(x_ptr, r_ptr, nw_ptr, sum_ptr, writes, rm, even + 1, M, K, stride_xm, NORM)
        acc = _dot(x_even, low, acc, DOT_BF16)
        return _dot(x_odd, high, acc, DOT_BF16), even_squares + odd_squares

    @triton.jit
    def _dot(x, w, acc, DOT_BF16: tl.constexpr):
        if DOT_BF16:  # tensor cores: bfloat16 products, float32 sums
            return tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        return tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")  # what the interpreter gets right
