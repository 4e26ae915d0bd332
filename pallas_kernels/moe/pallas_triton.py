"""MoE expert FFN as two Pallas-Triton grouped matmuls with MXFP4 decoded in the kernel.

Rows arrive sorted by expert with ragged group sizes. XLA turns the group sizes into a row-tile
plan (tile -> group, first row, end row), read by the kernels as small int32 arrays (Triton Pallas
has no scalar prefetch). The grid is static, sized for the worst case; tiles past the real ones
exit at once, so empty groups cost nothing. Group E of the plan is the padding rows past
sum(group_sizes): the down kernel writes them as zeros, so no extra pass clears the output. A
tile runs its dot at the smallest power-of-two height (16 or more) that fits its rows.

- gate/up kernel: h = act(x W_gate^T, x W_up^T) in the activation dtype, both accumulators fed by
  one load of the x tile, the activation in fp32 in the epilogue.
- down kernel: y = h W_down^T.

A weight tile is either MXFP4 (packed codes + E8M0 scales, decoded to the activation dtype right
before the dot) or a plain array (Kimi Linear), cast the same way. Dots accumulate in fp32.

The column block, warps and stages are keyword arguments of the public functions; row tiles and
reduction steps follow from the shapes (`_row_tile`, `_block_k`). The kernel indexes whole arrays
(no BlockSpecs): each ref is annotated with the array it holds and the tiles a program reads or
writes. Names carry the weight's dimensions where both orientations meet: E experts, N output
columns, K the reduction (D for gate/up, F for down).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe.mxfp4 import Mxfp4Tensor
from pallas_kernels.mxfp4_format import GROUP

_CONTRACT_LAST = (((1,), (1,)), ((), ()))  # [rows, k] . [n, k] -> [rows, n]


def expert_ffn(
    x_sorted,     # [M, D], rows sorted by expert
    group_sizes,  # [E] int32
    w_gate,       # [E, F, D]
    w_up,         # [E, F, D]
    w_down,       # [E, D, F]
    *,
    activation,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int = 3,
    interpret: bool = False,
):
    """See `pallas_kernels.moe.api.expert_ffn`. Needs D and F to be multiples of 32.

    block_n: output columns per program, at most (the largest power of 2 dividing the width and no
    more than block_n): small, for many programs on the weight-bound decode tiles. num_warps: None
    for 4 on row tiles of up to 32 rows and 8 on taller ones, whose fp32 accumulators need them."""
    if x_sorted.dtype not in (jnp.bfloat16, jnp.float32):  # the MXFP4 decode writes their exponent fields
        raise ValueError(f"x must be bf16 or f32 for the Pallas kernels, got {x_sorted.dtype}")
    m, d = x_sorted.shape
    num_experts, f, _ = w_gate.shape
    for name, size in (("D (expert input width)", d), ("F (expert intermediate width)", f)):
        if size % GROUP:
            raise ValueError(f"the Pallas MoE kernels need {name} to be a multiple of {GROUP}, got {size} "
                             f"(w_gate {tuple(w_gate.shape)})")
    block_m = _row_tile(m, num_experts)
    plan = _tile_plan(group_sizes.astype(jnp.int32), m, block_m)
    options = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
               "interpret": interpret}
    hidden_MF = _grouped_matmul(x_sorted, plan, (w_gate, w_up), activation=activation, **options)
    return _grouped_matmul(hidden_MF, plan, (w_down,), activation=None, **options)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation, **options):
    """See `pallas_kernels.moe.api.moe_ffn`: sorts the (token, slot) pairs by expert, runs
    `expert_ffn` (`options`: its keyword arguments) and sums each token's weighted expert outputs in
    fp32."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=w_gate.shape[0])
    y_sorted = expert_ffn(x[order // k], group_sizes, w_gate, w_up, w_down, activation=activation, **options)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
    return jnp.sum(topk_weights.astype(jnp.float32)[..., None] * y.astype(jnp.float32), axis=1)


def _row_tile(m: int, num_experts: int) -> int:
    """The most rows a tile holds: the power of two at or above the mean group size, 16..128.
    Decode (a few rows per expert) gets 16, the smallest height a tensor-core dot takes, and a
    kernel with one dot height; each non-empty group wastes less than one tile."""
    mean = -(-m // num_experts)
    return max(16, min(128, pl.next_power_of_2(mean)))


def _tile_plan(group_sizes, m: int, block_m: int):
    """int32 arrays (group, first row, end row) per row tile, for a static count of tiles.

    Group g < E gets ceil(size_g / block_m) tiles over its rows; group E is the padding rows
    [sum(group_sizes), m). At most ceil(m / block_m) + min(E, m) + 1 tiles are real (each non-empty
    group and the padding waste less than one tile); the rest are empty (end == first) and exit.
    """
    num_experts = group_sizes.shape[0]
    ends = jnp.append(jnp.minimum(jnp.cumsum(group_sizes), m), m)  # group E: the padding rows
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles)
    tile = jnp.arange(pl.cdiv(m, block_m) + min(num_experts, m) + 1, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, tile, side="right"), num_experts).astype(jnp.int32)
    first = starts[group] + (tile - (tile_ends - tiles)[group]) * block_m
    real = tile < tile_ends[-1]
    first = jnp.where(real, first, 0)
    end = jnp.where(real, jnp.minimum(first + block_m, ends[group]), 0)
    return group, first, end


def _block_k(height: int, k: int) -> int:
    """Reduction step (whole MXFP4 groups, a power of two dividing k): long weight loads for short
    tiles, which are weight-bound; shorter for tall ones, whose fp32 accumulators fill registers."""
    return _largest_pow2_divisor(k, 128 if height <= 32 else 64)


def _largest_pow2_divisor(size: int, cap: int) -> int:
    return min(cap, size & -size)


def _grouped_matmul(x_MK, plan, weights, *, block_m, activation, block_n, num_warps, num_stages, interpret):
    """act(x W_0^T, x W_1^T) for two weights [E, N, K] (gate, up), x W_0^T for one (down); [M, N] in
    x's dtype."""
    m, _ = x_MK.shape
    num_experts, n, _ = weights[0].shape
    block_n = _largest_pow2_divisor(n, block_n)
    quantized = isinstance(weights[0], Mxfp4Tensor)
    leaves = [leaf for w in weights for leaf in (w if quantized else (w,))]
    kernel = functools.partial(_kernel, num_experts=num_experts, block_m=block_m, block_n=block_n,
                               refs_per_weight=2 if quantized else 1, activation=activation)
    if num_warps is None:
        num_warps = 4 if block_m <= 32 else 8
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x_MK.dtype),
        grid=(plan[0].shape[0], n // block_n),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="moe_gate_up" if len(weights) == 2 else "moe_down",
    )(*plan, x_MK, *leaves)


def _kernel(
    group_ref,  # [tiles] int32: a row tile's expert (E: the padding rows)
    first_ref,  # [tiles] int32: its first row
    end_ref,    # [tiles] int32: one past its last row
    x_ref,      # [M, K], read as [height, block_k] tiles
    *refs,      # per weight [E, N, K] (plain), or packed uint8 [E, N, K/2] and scales uint8 [E, N, K/32]
                # (MXFP4), read as one expert's [block_n, block_k] tiles; then out [M, N], written as
                # one [height, block_n] tile
    num_experts: int,
    block_m: int,
    block_n: int,
    refs_per_weight: int,
    activation,
):
    """One (row tile, column block); all grid axes are independent.

    A tile holds up to block_m rows but runs the dot at the smallest power-of-two height (16 or
    more) that fits its rows: under expert parallelism most of the m rows are other devices'
    (padding), so a tile sized from m alone would multiply mostly masked rows.
    """
    *weight_refs, out_ref = refs
    weights = [weight_refs[i:i + refs_per_weight] for i in range(0, len(weight_refs), refs_per_weight)]
    tile = pl.program_id(0)
    group, first, end = group_ref[tile], first_ref[tile], end_ref[tile]
    cols = pl.ds(pl.program_id(1) * block_n, block_n)
    rows = end - first
    for height in (16 << i for i in range((block_m // 16).bit_length())):  # 16, 32, ..., block_m
        fewest = height // 2 + 1 if height > 16 else 1
        pl.when((rows >= fewest) & (rows <= height) & (group < num_experts))(functools.partial(
            _tile_matmul, x_ref, weights, out_ref, group, first, end, cols, height, activation))
    if activation is None:  # the down kernel writes the padding rows (group E) as zeros
        @pl.when((rows > 0) & (group == num_experts))
        def _padding():
            plgpu.store(out_ref.at[pl.ds(first, block_m), cols], jnp.zeros((block_m, block_n), out_ref.dtype),
                        mask=_row_mask(first, end, block_m, block_n))


def _tile_matmul(x_ref, weights, out_ref, group, first, end, cols, height, activation):
    """out[first:end, cols] for rows [first, end) of expert `group`, at most `height` of them."""
    k = x_ref.shape[1]
    block_k = _block_k(height, k)
    row_mask = _row_mask(first, end, height, block_k)
    rows = pl.ds(first, height)

    def step(i, accs):
        x = plgpu.load(x_ref.at[rows, pl.ds(i * block_k, block_k)], mask=row_mask, other=0)  # [height, block_k]
        return tuple(acc + jax.lax.dot_general(x, _weight_tile(w, group, cols, i, block_k, x.dtype), _CONTRACT_LAST,
                                               preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, weights))

    zeros = jnp.zeros((height, cols.size), jnp.float32)  # one [height, block_n] accumulator per weight
    accs = jax.lax.fori_loop(0, k // block_k, step, (zeros,) * len(weights))
    out = activation(*accs) if activation is not None else accs[0]
    plgpu.store(out_ref.at[rows, cols], out.astype(out_ref.dtype), mask=_row_mask(first, end, height, cols.size))


def _row_mask(first, end, height: int, width: int):
    """[height, width] mask of the rows before `end`, counting from `first`."""
    return jnp.broadcast_to(((first + jnp.arange(height)) < end)[:, None], (height, width))


def _weight_tile(refs, expert, cols, step, block_k, dtype):
    """The [block_n, block_k] tile of one expert's [E, N, K] weight, in `dtype`."""
    if len(refs) == 1:  # plain weights
        return refs[0][expert, cols, pl.ds(step * block_k, block_k)].astype(dtype)
    packed_ref, scales_ref = refs
    packed = packed_ref[expert, cols, pl.ds(step * (block_k // 2), block_k // 2)]  # [block_n, block_k / 2]
    scales = scales_ref[expert, cols, pl.ds(step * (block_k // GROUP), block_k // GROUP)]  # [block_n, block_k / 32]
    return _decode_mxfp4(packed, scales, dtype)


def _decode_mxfp4(packed, scales, dtype):
    """[n, k] weights in `dtype` (bf16 or f32) from packed uint8 [n, k/2] and scale bytes [n, k/32].

    Both nibbles of a byte share a scale, so each is decoded at the byte's position and the two
    halves are interleaved last (low nibble = even input), moving 16-bit values rather than codes.
    A scale byte is the exponent field of 2**(byte - 127) (E8M0 and f32/bf16 share the bias 127);
    one multiply applies it. Every value is exact (a 2-bit significand times a power of two).
    Scale byte 0 gives 0 rather than the subnormal 2**-127 and byte 255 (NaN in E8M0; checkpoints do not use it) gives
    +-inf rather than NaN.
    """
    n, half = packed.shape
    groups = scales.shape[1]
    scale = _from_bits(scales.astype(jnp.uint32) << jnp.finfo(dtype).nmant, dtype)
    scale = jnp.broadcast_to(scale[:, :, None], (n, groups, GROUP // 2)).reshape(n, half)  # per byte
    byte = packed.astype(jnp.uint32)
    low, high = (_e2m1(codes, dtype) * scale for codes in (byte & 0xF, byte >> 4))
    return jnp.stack([low, high], axis=-1).reshape(n, 2 * half)


def _e2m1(codes, dtype):
    """E2M1 codes (uint32, 0..15) as values in `dtype`, built as bit patterns."""
    nmant = jnp.finfo(dtype).nmant
    width = 8 * jnp.dtype(dtype).itemsize
    mag = codes & 7  # 2 exponent bits e, 1 mantissa bit m
    # mag >= 2 is 2**(e-1) * (1 + m/2): exponent field e + 126, m the top mantissa bit. mag 1 is 0.5.
    bits = jnp.where(mag >= 2, (mag << (nmant - 1)) + (126 << nmant), jnp.where(mag == 1, 126 << nmant, 0))
    return _from_bits(bits | ((codes & 8) << (width - 4)), dtype)  # with the sign bit


def _from_bits(bits, dtype):
    """uint32 bit patterns (in the low bits) as values of `dtype`."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.uint32),
                                        dtype)
