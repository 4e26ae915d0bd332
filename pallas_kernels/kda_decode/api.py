"""One decode step of a KDA layer for a batch of sequences whose states live in slot pools.

    o, conv_pool, state_pool = kda_decode(qkv, conv_weight, conv_pool, f, dt_bias, A_log, beta_logits,
                                          state_pool, slots, gate_lower_bound=-5.0)

Shapes, in the layer's own layout (k3jax/layers/kda.py; ARCHITECTURE.md, "KDA"): N rows, T new tokens per row
(static and small: 1 for decode, up to 8 to verify a speculative window), H heads of size D (K = V
= D), P = H * D, W conv taps, S slots.
- qkv [N, T, 3, P]: the pre-conv q, k, v projections (activation dtype, e.g. bf16). q, k and v
  keep their own axis so that P splits over tensor-parallel devices with the heads.
- conv_weight [W, 3, P] fp32, the last tap on the current token; conv_pool [S, W-1, 3, P]: each
  slot's last W-1 pre-conv rows (any float dtype; read in the activation dtype).
- f [N, T, P] fp32: the forget-gate input (f_b_proj's output); dt_bias [P] and A_log [H] are the
  layer's parameters, added and applied here. The gate is K3's safe gate
  g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) when gate_lower_bound is given (a
  static float), else Kimi Linear's g = -exp(A_log) * softplus(f + dt_bias).
- beta_logits [N, T, H] (sigmoid inside); state_pool [S, H, D, D] fp32, the state as [K, V].
- slots int32 [N]: row n reads and writes slot slots[n]. Slot 0 is the null slot that padding rows
  point at: its contents are garbage, and padding rows never disturb real rows or their slots.
  Real rows must use distinct slots other than 0.
q and k are L2-normalised inside (x / sqrt(sum x^2 + 1e-6)), q scaled by D**-0.5. The post-conv
activations are rounded to the activation dtype, as the model does.

Results: o [N, T, H, D] in the activation dtype (before the layer's gated output norm), and the
pools with each real row's slot holding the conv window and state after its T tokens. The pools
are updated in place (the Pallas kernel aliases them to its outputs; the XLA paths scatter), so
under jit with the pools donated nothing is copied.

Speculative decoding (return_states=True, static): returns (o, states) with states
[N, T, H, D, D] fp32, the state after each of the T positions, and leaves the pools untouched.
Once the number of accepted tokens a_n (1..T) of each row is known, `commit_accepted` writes the
state after a_n tokens and the matching conv window (rows a_n .. a_n + W-2 of the old window
followed by qkv, so it needs no extra output) into the slots. Not committing in the verify step is
what makes the rollback possible: the old conv window is still in the pool. The price is that the
states are held until acceptance is known: N * T * H * D * D * 4 bytes per layer.

impl: "auto" (Pallas on a GPU when D suits Triton, XLA otherwise), "xla", "reference" or "pallas"
(the Pallas-Triton kernel; off a GPU it runs in interpret mode, slow, for tests). Under a mesh the
kernel runs per shard, each device on its heads (pallas_kernels.dispatch). `**tuning`: keyword
arguments of the Pallas kernel (pallas_triton.kda_decode's tile width, warps, stages, which hold the
defaults); the other implementations take none and ignore them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.kda_decode import pallas_triton, reference, xla

_STATIC = ("gate_lower_bound", "return_states")
_IMPLS = {
    "reference": jax.jit(reference.kda_decode, static_argnames=_STATIC),
    "xla": jax.jit(xla.kda_decode, static_argnames=_STATIC),
    "pallas": pallas_triton.kda_decode,  # jitted where it is defined, its tuning knobs static too
}


def kda_decode(qkv, conv_weight, conv_pool, f, dt_bias, A_log, beta_logits, state_pool, slots, *,
               gate_lower_bound=None, return_states=False, impl="auto", **tuning):
    """Returns (o, conv_pool, state_pool), or (o, states) with return_states=True (module docstring)."""
    args = tuple(map(jnp.asarray, (qkv, conv_weight, conv_pool, f, dt_bias, A_log, beta_logits, state_pool, slots)))
    _check(*args)
    impl = dispatch.resolve(impl, _fits_pallas(args[7].shape[2]),
                            f"state_pool {args[7].shape}: the head size must be a power of 2 >= 16")
    gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
    if impl != "pallas":
        return _IMPLS[impl](*args, gate_lower_bound=gate_lower_bound, return_states=return_states)

    def kernel(*args):
        return _IMPLS["pallas"](*args, gate_lower_bound=gate_lower_bound, return_states=return_states,
                                interpret=not dispatch.on_gpu(), **tuning)
    # Each device on its heads (the channel axis P is head-major). Rows stay whole: the pools are
    # written, and a device's copy must hold every row's update.
    qkv, conv, per_token, state = ((None, None, None, "heads"), (None, None, "heads"), (None, None, "heads"),
                                   (None, "heads", None, None))
    roles = (qkv, conv, qkv, per_token, ("heads",), ("heads",), per_token, state, None)
    o = (None, None, "heads", None)
    out = (o, (None, None, "heads", None, None)) if return_states else (o, qkv, state)
    return dispatch.per_shard(kernel, args, roles, out)


def commit_accepted(conv_pool, state_pool, slots, qkv, states, accepted):
    """After a return_states=True step: each row's slot gets the state and conv window after its
    first accepted[n] tokens (int32 [N], 1..T; padding rows may hold anything). Returns
    (conv_pool, state_pool), scattered in place under jit when the pools are donated. qkv and states
    are the step's input and output."""
    n, t = jnp.shape(qkv)[:2]
    expected = {"states": (states, (n, t, *jnp.shape(state_pool)[1:])), "slots": (slots, (n,)),
                "accepted": (accepted, (n,))}
    for name, (x, shape) in expected.items():
        if jnp.shape(x) != shape:
            raise ValueError(f"{name} has shape {jnp.shape(x)}, expected {shape} (from qkv {jnp.shape(qkv)} and "
                             f"state_pool {jnp.shape(state_pool)})")
    return _commit(conv_pool, state_pool, slots, qkv, states, accepted)


@jax.jit
def _commit(conv_pool, state_pool, slots, qkv, states, accepted):
    n, t = qkv.shape[:2]
    accepted = jnp.clip(accepted, 1, t)
    window = jnp.concatenate([conv_pool[slots].astype(qkv.dtype), qkv], axis=1)  # [N, W-1+T, 3, P]
    rows = accepted[:, None] + jnp.arange(conv_pool.shape[1])[None, :]  # the W-1 rows ending at the last accepted token
    conv = jnp.take_along_axis(window, rows[:, :, None, None], axis=1)
    state = states[jnp.arange(n), accepted - 1]
    return conv_pool.at[slots].set(conv.astype(conv_pool.dtype)), state_pool.at[slots].set(state)


def _check(qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots):
    if qkv.ndim != 4 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [N, T, 3, P], got shape {qkv.shape}")
    n, t, _, p = qkv.shape
    if a_log.ndim != 1 or a_log.shape[0] == 0 or p % a_log.shape[0]:
        raise ValueError(f"A_log must be [H] with H dividing P = {p} (qkv {qkv.shape}), got shape {a_log.shape}")
    h = a_log.shape[0]
    d = p // h
    if conv_weight.ndim != 3 or conv_weight.shape[0] < 2 or conv_weight.shape[1:] != (3, p):
        raise ValueError(f"conv_weight must be [W, 3, P] with W >= 2 and P = {p}, got shape {conv_weight.shape}")
    w = conv_weight.shape[0]
    if conv_pool.ndim != 4 or conv_pool.shape[1:] != (w - 1, 3, p):
        raise ValueError(f"conv_pool must be [S, W-1, 3, P] = [S, {w - 1}, 3, {p}], got shape {conv_pool.shape}")
    s = conv_pool.shape[0]
    expected = {"f": (f, (n, t, p)), "dt_bias": (dt_bias, (p,)), "beta_logits": (beta_logits, (n, t, h)),
                "state_pool": (state_pool, (s, h, d, d)), "slots": (slots, (n,))}
    for name, (x, shape) in expected.items():
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} (from qkv {qkv.shape}, A_log "
                             f"{a_log.shape}, conv_pool {conv_pool.shape})")
    for name, x in (("conv_weight", conv_weight), ("f", f), ("dt_bias", dt_bias), ("A_log", a_log),
                    ("state_pool", state_pool)):
        if x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32, got {x.dtype}")
    for name, x in (("qkv", qkv), ("conv_pool", conv_pool), ("beta_logits", beta_logits)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {x.dtype}")
    if slots.dtype != jnp.int32:
        raise ValueError(f"slots must be int32, got {slots.dtype}")


def _fits_pallas(size):
    """Triton blocks are powers of 2; 16 is the smallest the state tiles are laid out for."""
    return size >= 16 and size & (size - 1) == 0
