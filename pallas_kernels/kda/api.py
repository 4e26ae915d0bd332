"""Kimi Delta Attention, in fla's `chunk_kda` / `fused_recurrent_kda` conventions (DESIGN.md 3 and 6).

Layout [B, T, H, D]; g is the per-channel log decay (<= 0) after the gate function; beta in (0, 1);
q and k arrive L2-normalised unless use_qk_l2norm_in_kernel=True; scale multiplies q (default
K**-0.5); the output at t includes token t. initial_state / final_state are fp32 [N, H, K, V] (N = B,
or one row per packed sequence when cu_seqlens is given, with B = 1). Computation is fp32 whatever
the input dtype; o comes back in v's dtype.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.kda import reference, xla

L2_EPS = 1e-6  # inside the square root, as fla and the K3 engines


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False, impl="auto"):
    """Chunked parallel form (prefill). Returns (o [B, T, H, V], final_state or None)."""
    fn = {"xla": xla.chunk_kda, "reference": reference.recurrent_kda}[_impl(impl)]
    return _call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False, impl="auto"):
    """Token-by-token form (decode). Same contract as chunk_kda."""
    fn = {"xla": xla.fused_recurrent_kda, "reference": reference.recurrent_kda}[_impl(impl)]
    return _call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel)


def _impl(impl: str) -> str:
    if impl == "auto":
        return "xla"
    if impl == "pallas":
        raise ValueError("impl='pallas': the Pallas KDA kernels are not available yet; use 'auto' or 'xla'")
    if impl not in ("xla", "reference"):
        raise ValueError(f"unknown impl {impl!r}; choose 'auto', 'xla' or 'reference'")
    return impl


def _call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2norm):
    b, t, h, dk = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    dv, out_dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = (a.astype(jnp.float32) for a in (q, k, v, g, beta))
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    num_states = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = jnp.zeros((num_states, h, dk, dv), jnp.float32)
    o, final = fn(q, k, v, g, beta, scale=dk ** -0.5 if scale is None else scale,
                  initial_state=initial_state.astype(jnp.float32), cu_seqlens=cu_seqlens)
    return o.astype(out_dtype), final if output_final_state else None


def _l2norm(x):
    return x * (1.0 / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS))


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
    b, t, h, dk = q.shape
    for name, x, shape in (("k", k, (b, t, h, dk)), ("g", g, (b, t, h, dk)), ("beta", beta, (b, t, h))):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} to match q {q.shape}")
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v has shape {v.shape}, expected [B, T, H, V] with [B, T, H] = {(b, t, h)}")
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens needs a batch of 1 (packed sequences), got B={b}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be [N + 1] offsets, got shape {cu_seqlens.shape}")
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (n, h, dk, v.shape[-1]):
        raise ValueError(f"initial_state has shape {initial_state.shape}, expected {(n, h, dk, v.shape[-1])}")
    return b, t, h, dk
