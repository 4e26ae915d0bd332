"""The KDA decode step as one Pallas-Triton kernel (NVIDIA, and AMD through ROCm).

One program per (row, head), grid (N, H). It reads the row's slot, computes the head's q and k
for the T tokens once (conv window + SiLU, L2 norm), the gate and beta, then walks the head's state
in [K, block_v] column tiles: load the tile, run the T tokens on it (their v columns convolved there),
store the outputs and the tile. The conv window and the state are written back in place (the pools
are aliased to the outputs), the window's v columns by the tile that owns them.

Why not one program per V-tile as well: the q and k conv windows of a head are read by every
V-tile and rewritten in place, so splitting the head over programs would let one program
overwrite the window another has yet to read. A whole head per program still gives N * H programs
(768 at N = 64, H = 12), with each tile a 16 KiB load, which keeps plenty of loads in flight for a
memory-bound step.

The products are elementwise multiplies and sums in fp32 (matrix-vector products: no tensor-core
shape to fill), so the kernel is exact fp32 like the reference.

The tile width, warps and stages are keyword arguments of `kda_decode`. The kernel indexes whole
arrays (no BlockSpecs): each ref is annotated with the array it holds and the part a program reads
or writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda_decode.reference import L2_NORM_EPS, SOFTPLUS_LINEAR_ABOVE


def _l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x) + L2_NORM_EPS)


def _kernel(
    slots_ref,        # [N] int32
    a_log_ref,        # [H] fp32, one value per program
    qkv_ref,          # [N, T, 3, P], read as [D] or [block_v] rows of the row's tokens
    conv_weight_ref,  # [W, 3, P] fp32, likewise
    conv_pool_ref,    # [S, W-1, 3, P], the slot's window read likewise
    f_ref,            # [N, T, P] fp32, read as [D] rows
    dt_bias_ref,      # [P] fp32, read as one [D] row
    beta_ref,         # [N, T, H], one value per token
    state_pool_ref,   # [S, H, D, D] fp32, the slot's state read as [D, block_v] tiles
    o_ref,            # [N, T, H, D], written as one [block_v] row per token and tile
    *out_refs,        # conv_pool and state_pool (aliased to the inputs), or states [N, T, H, D, D] fp32
    gate_lower_bound: float | None,
    return_states: bool,
    block_v: int,
):
    """Pool inputs are read, aliased pool outputs written (the same buffers on a GPU)."""
    row, head = pl.program_id(0), pl.program_id(1)
    num_tokens, d = o_ref.shape[1], o_ref.shape[3]
    width = conv_weight_ref.shape[0]
    slot = slots_ref[row]
    act = qkv_ref.dtype

    def conv_silu(channel, columns):
        """Post-conv fp32 [len(columns)] of q/k/v (channel 0/1/2) for each token, and the rows of the
        window after the last one (the new conv state)."""
        window = [conv_pool_ref[slot, j, channel, columns].astype(act) for j in range(width - 1)]
        window += [qkv_ref[row, i, channel, columns] for i in range(num_tokens)]
        weight = [conv_weight_ref[j, channel, columns] for j in range(width)]
        out = []
        for i in range(num_tokens):
            acc = sum(weight[j] * window[i + j].astype(jnp.float32) for j in range(width))
            out.append((acc * jax.nn.sigmoid(acc)).astype(act).astype(jnp.float32))  # rounded as the model
        return out, window[num_tokens:]

    def store_window(channel, columns, rows):
        if not return_states:
            for j, x in enumerate(rows):
                out_refs[0][slot, j, channel, columns] = x.astype(out_refs[0].dtype)

    head_columns = pl.ds(head * d, d)
    (q, q_window), (k, k_window) = conv_silu(0, head_columns), conv_silu(1, head_columns)
    store_window(0, head_columns, q_window)
    store_window(1, head_columns, k_window)
    q = [d ** -0.5 * _l2_normalize(x) for x in q]
    k = [_l2_normalize(x) for x in k]
    a = jnp.exp(a_log_ref[head])
    decay, beta = [], []
    for i in range(num_tokens):
        s = f_ref[row, i, head_columns] + dt_bias_ref[head_columns]
        if gate_lower_bound is not None:  # K3's safe gate
            g = gate_lower_bound * jax.nn.sigmoid(a * s)
        else:  # Kimi Linear: -a softplus(s)
            g = -a * jnp.where(s > SOFTPLUS_LINEAR_ABOVE, s, jnp.log1p(jnp.exp(jnp.minimum(s, SOFTPLUS_LINEAR_ABOVE))))
        decay.append(jnp.exp(g)[:, None])
        beta.append(jax.nn.sigmoid(beta_ref[row, i, head].astype(jnp.float32)))

    for start in range(0, d, block_v):
        columns = pl.ds(start, block_v)
        v, v_window = conv_silu(2, pl.ds(head * d + start, block_v))
        store_window(2, pl.ds(head * d + start, block_v), v_window)
        state = state_pool_ref[slot, head, :, columns]  # [D, block_v]
        for i in range(num_tokens):
            state = decay[i] * state
            error = v[i] - jnp.sum(k[i][:, None] * state, axis=0)
            state = state + k[i][:, None] * (beta[i] * error)[None, :]
            o_ref[row, i, head, columns] = jnp.sum(q[i][:, None] * state, axis=0).astype(o_ref.dtype)
            if return_states:
                out_refs[0][row, i, head, :, columns] = state
        if not return_states:
            out_refs[1][slot, head, :, columns] = state


@functools.partial(jax.jit, static_argnames=("gate_lower_bound", "return_states", "block_v", "num_warps",
                                             "num_stages", "interpret"))
def kda_decode(qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots, *,
               gate_lower_bound, return_states, block_v: int = 32, num_warps: int = 4, num_stages: int = 1,
               interpret: bool = False):
    """Arguments and results as api.kda_decode; the head size a power of 2 of at least 16. block_v:
    the state columns held at a time, a power of 2 (at most D): [128, 32] fp32 is 32 registers a
    thread at four warps."""
    n, t = qkv.shape[:2]
    h, d = state_pool.shape[1], state_pool.shape[2]
    o = jax.ShapeDtypeStruct((n, t, h, d), qkv.dtype)
    if return_states:
        out_shape = (o, jax.ShapeDtypeStruct((n, t, h, d, d), jnp.float32))
        aliases = {}
    else:  # the pools (inputs 4 and 8) are outputs 1 and 2, updated in place
        out_shape = (o, jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                     jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype))
        aliases = {4: 1, 8: 2}
    return pl.pallas_call(
        functools.partial(_kernel, gate_lower_bound=gate_lower_bound, return_states=return_states,
                          block_v=min(block_v, d)),
        grid=(n, h),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_decode",
    )(slots, a_log, qkv, conv_weight, conv_pool, f, dt_bias, beta_logits, state_pool)
