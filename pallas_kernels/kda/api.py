"""Kimi Delta Attention, in fla's `chunk_kda` / `fused_recurrent_kda` conventions (ARCHITECTURE.md, "Kernels").

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
- impl: "auto" (Pallas on GPU, the XLA path elsewhere or when K or V does not suit Pallas), "xla",
  "reference" or "pallas" (the Pallas-Triton kernels, pallas_triton.py; off a GPU they run in
  interpret mode, which is slow and only for tests). Pallas needs K and V powers of 2 of at least 16.
  pallas_kernels.dispatch says how "auto" chooses and how the kernels run per shard under a mesh.
  On CPU, "auto" runs chunk_kda as the token scan while the states fit in cache (SCAN_STATE_VALUES);
  impl="xla" always runs the chunked XLA form.
- `**tuning`: keyword arguments of the Pallas kernel (chunk size, tile sizes, warps, stages: see
  pallas_triton.chunk_kda and fused_recurrent_kda, which hold the defaults); the other
  implementations take none and ignore them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.kda import pallas_triton, reference, xla


def _jit(fn):
    """Jitted here so that eager callers (tests, notebooks) compile each shape once; under an outer
    jit it is inlined. Only the switch is static: scale stays a traced scalar. (The Pallas functions
    are jitted where they are defined, with their tuning knobs static.)"""
    return jax.jit(fn, static_argnames=("l2norm",))


_RECURRENT = _jit(reference.recurrent_kda)
# On CPU the token scan is the faster prefill while the states it carries (all sequences, fp32) fit in
# cache, at any length; past that the chunked form's matmuls win on long prompts. Below a few hundred
# tokens the chunked form's fixed cost, hundreds of small ops per layer, also dominates a serving
# step's prefill of a short prompt (benchmarks/kda_chunked_vs_recurrent.py).
SCAN_STATE_VALUES = 1 << 16
# impl -> (chunked form, token-by-token form). The XLA token form is the reference scan: one fused
# step per token is already the fastest XLA form for a handful of tokens.
_IMPLS = {
    "reference": (_RECURRENT, _RECURRENT),
    "xla": (_jit(xla.chunk_kda), _RECURRENT),
    "pallas": (pallas_triton.chunk_kda, pallas_triton.fused_recurrent_kda),
}


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False, impl="auto", **tuning):
    """Chunked parallel form, for prefill. Returns (o [B, T, H, V], final_state [N, H, K, V] or None)."""
    resolved = _resolve(impl, q, v)
    form = 1 if impl == "auto" and resolved == "xla" and auto_runs_scan(q, v, cu_seqlens) else 0
    return _call(_IMPLS[resolved][form], resolved, q, k, v, g, beta, scale, initial_state, output_final_state,
                 cu_seqlens, use_qk_l2norm_in_kernel, tuning)


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False, impl="auto", **tuning):
    """Token-by-token form, for decode (T small). Same contract as chunk_kda."""
    impl = _resolve(impl, q, v)
    return _call(_IMPLS[impl][1], impl, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel, tuning)


def auto_runs_scan(q, v, cu_seqlens=None) -> bool:
    """Whether chunk_kda's "auto" runs the token scan: on CPU, with at most SCAN_STATE_VALUES state values.
    Asked before _check: malformed shapes get its errors, not one from here."""
    q_shape = jnp.shape(q)
    if len(q_shape) != 4:
        return True
    cu_shape = None if cu_seqlens is None else jnp.shape(cu_seqlens)
    num_states = q_shape[0] if cu_shape is None else cu_shape[0] - 1 if cu_shape else 0
    values = num_states * q_shape[2] * q_shape[3] * jnp.shape(v)[-1]
    return jax.default_backend() == "cpu" and values <= SCAN_STATE_VALUES


def _resolve(impl, q, v):
    fits = all(_fits_pallas(jnp.shape(x)[-1]) for x in (q, v))
    return dispatch.resolve(impl, fits, f"q {jnp.shape(q)}, v {jnp.shape(v)}: K and V must be powers of 2 >= 16")


def _call(fn, impl, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2norm, tuning):
    q, k, v, g, beta = map(jnp.asarray, (q, k, v, g, beta))
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    num_states = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    b, t, h, dk = q.shape
    dv = v.shape[3]
    if initial_state is None:
        initial_state = jnp.zeros((num_states, h, dk, dv), jnp.float32)
    # The Pallas kernels work on packed sequences: rows of a batch are sequences of T tokens one
    # after another (a free reshape).
    repack = cu_seqlens is None and impl == "pallas"
    if repack:
        q, k, v, g, beta = (x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu_seqlens = jnp.arange(b + 1, dtype=jnp.int32) * t
    # The implementations cast to fp32, normalise and scale as they load the inputs, so no fp32
    # copy of the whole sequence is made here.
    args = (q, k, v, g, beta, dk ** -0.5 if scale is None else scale, jnp.asarray(initial_state, jnp.float32),
            cu_seqlens)
    if impl == "pallas":
        o, final_state = _pallas_per_shard(fn, args, l2norm, tuning)
    else:
        o, final_state = fn(*args[:5], scale=args[5], initial_state=args[6], cu_seqlens=cu_seqlens, l2norm=l2norm)
    if repack:
        o = o.reshape(b, t, h, dv)
    return o.astype(v.dtype), final_state if output_final_state else None


def _pallas_per_shard(fn, args, l2norm, tuning):
    """The Pallas kernels on packed sequences, each device on its heads (pallas_kernels.dispatch)."""
    def kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens):
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, l2norm=l2norm,
                  interpret=not dispatch.on_gpu(), **tuning)
    tokens, state = (None, None, "heads", None), (None, "heads", None, None)
    roles = (tokens, tokens, tokens, tokens, (None, None, "heads"), None, state, None)
    return dispatch.per_shard(kernel, args, roles, (tokens, state))


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    """Validates the arguments; returns N, the number of sequences (rows of the states)."""
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


def _fits_pallas(size):
    """Triton tiles are powers of 2, and tensor-core products take at least 16 in each dimension."""
    return size >= 16 and size & (size - 1) == 0
