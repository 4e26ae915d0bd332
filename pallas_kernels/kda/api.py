"""Kimi Delta Attention, in fla's `chunk_kda` / `fused_recurrent_kda` conventions (DESIGN.md 3 and 6).

- q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] the per-channel log decay (<= 0) after the
  gate function; beta [B, T, H] in (0, 1).
- q and k arrive L2-normalised over K unless use_qk_l2norm_in_kernel=True, which normalises them
  inside as x / sqrt(sum x^2 + 1e-6). `scale` multiplies q and defaults to K**-0.5.
- Per head, with the state S [K, V]: S <- diag(exp(g_t)) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
  o_t = S^T (scale q_t), so the output at t includes token t.
- initial_state / final_state are fp32 [N, H, K, V]: N = B, or with `cu_seqlens` (int32 [N + 1]
  offsets of packed sequences, from 0 to T, B = 1) one row per sequence. No initial_state means
  zeros. cu_seqlens may be traced: every shape follows from T and N.
- Everything is computed in fp32 whatever the input dtypes. o comes back in v's dtype (fla uses
  q's; the two agree in practice, and o is a mix of v rows); final_state is fp32.
- impl: "auto" (the XLA path on every backend for now), "xla" or "reference". The Pallas kernel
  is a later issue; "pallas" raises ValueError until it exists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference, xla

# Jitted here so that eager callers (tests, notebooks) compile each shape once; under an outer jit
# these are inlined. Only the l2norm switch is static: scale stays a traced scalar.
_recurrent = jax.jit(reference.recurrent_kda, static_argnames="l2norm")
_chunked = jax.jit(xla.chunk_kda, static_argnames="l2norm")


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False, impl="auto"):
    """Chunked parallel form, for prefill. Returns (o [B, T, H, V], final_state [N, H, K, V] or None)."""
    fn = {"xla": _chunked, "reference": _recurrent}[_resolve(impl)]
    return _call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False, impl="auto"):
    """Token-by-token form, for decode (T small). Same contract as chunk_kda.

    Its XLA path is the reference scan: one fused step per token is already the fastest XLA form
    for a handful of tokens.
    """
    fn = {"xla": _recurrent, "reference": _recurrent}[_resolve(impl)]
    return _call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def _resolve(impl):
    if impl == "auto":
        return "xla"
    if impl == "pallas":
        raise ValueError("impl='pallas': the Pallas KDA kernel is not available yet; use impl='auto' or 'xla'")
    if impl not in ("xla", "reference"):
        raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'xla', 'reference' or 'pallas'")
    return impl


def _call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2norm):
    q, k, v, g, beta = map(jnp.asarray, (q, k, v, g, beta))
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    num_states = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    h, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    if initial_state is None:
        initial_state = jnp.zeros((num_states, h, dk, dv), jnp.float32)
    # The implementations cast to fp32, normalise and scale as they load the inputs, so no fp32
    # copy of the whole sequence is made here.
    o, final_state = fn(q, k, v, g, beta, scale=dk ** -0.5 if scale is None else scale,
                        initial_state=jnp.asarray(initial_state, jnp.float32), cu_seqlens=cu_seqlens,
                        l2norm=l2norm)
    return o.astype(v.dtype), final_state if output_final_state else None


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    """Validates the shapes; returns N, the number of sequences (rows of the states)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
    b, t, h, dk = q.shape
    for name, x, shape in (("k", k, (b, t, h, dk)), ("g", g, (b, t, h, dk)), ("beta", beta, (b, t, h))):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} to match q {q.shape}")
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v has shape {v.shape}, expected [B, T, H, V] with [B, T, H] = {(b, t, h)} from q")
    num_states = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens packs sequences along T and needs B = 1, got B = {b}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be [N + 1] offsets, got shape {cu_seqlens.shape}")
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must hold integer offsets, got dtype {cu_seqlens.dtype}")
        num_states = cu_seqlens.shape[0] - 1
    expected = (num_states, h, dk, v.shape[3])
    if initial_state is not None and initial_state.shape != expected:
        raise ValueError(f"initial_state has shape {initial_state.shape}, expected [N, H, K, V] = {expected}")
    return num_states
