"""Routed-expert FFN: the XLA strategies and the reference against a NumPy float64 computation."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.activations import GatedActivation
from pallas_kernels.moe import Mxfp4Tensor, SplitExperts, expert_ffn, moe_ffn, split_experts, split_gate_up, stacked, xla
from tests.convert.test_mxfp4 import np_decode

E, F, D = 8, 32, 64
SITU = GatedActivation("situ", 4.0, 25.0)
SILU = GatedActivation("silu")
DTYPES = {"f32": (jnp.float32, np.float32), "bf16": (jnp.bfloat16, ml_dtypes.bfloat16)}
# "loop" and "ragged_dot" are the two grouped-matmul strategies of impl="xla" (CPU uses "loop");
# "split" is the loop over SplitExperts weights (one buffer per expert, large experts on CPU), and
# "split_gate_up" the same with each expert's gate and up in one buffer (K3Model's CPU layout).
IMPLS = ["loop", "split", "split_gate_up", "ragged_dot", "reference"]
MOE_IMPLS = IMPLS + ["dense"]  # moe_ffn's training strategy: every token through every expert, gated
SPLITS = {"split": lambda w1, w3, w2: tuple(map(split_experts, (w1, w3, w2))),
          "split_gate_up": lambda w1, w3, w2: (*split_gate_up(w1, w3), split_experts(w2))}

# Tolerances relative to the largest |output|. f32: fp32 sums of <= 64 products, a few 2**-24
# roundings each. bf16: the hidden activation and each expert's output are rounded to bf16 (half
# an ulp, 2**-9 relative); fp32 evaluation order can flip such a rounding against the float64
# oracle, moving a value by one bf16 ulp (2**-8), so allow 2**-7 (2 ulps).
TOL = {"f32": 2e-6, "bf16": 2.0 ** -7}


def weights(kind, seed=0):
    """w_gate, w_up [E, F, D] and w_down [E, D, F]: MXFP4 (random codes, scales giving outputs of
    order 1) or plain f32."""
    rng = np.random.default_rng(seed)

    def one(out, inp):
        if kind == "mxfp4":
            return Mxfp4Tensor(jnp.asarray(rng.integers(0, 256, (E, out, inp // 2)), jnp.uint8),
                               jnp.asarray(rng.integers(121, 125, (E, out, inp // 32)), jnp.uint8))
        return jnp.asarray(rng.standard_normal((E, out, inp)) / np.sqrt(inp), jnp.float32)

    return one(F, D), one(F, D), one(D, F)


def np_weights(ws, np_dtype):
    """float64 weights as the kernels see them: MXFP4 decoded independently, plain ones rounded to
    the activation dtype."""
    def one(w):
        if isinstance(w, Mxfp4Tensor):
            return np_decode(np.asarray(w.packed), np.asarray(w.scales))
        return np.asarray(w).astype(np_dtype).astype(np.float64)
    return [one(w) for w in ws]


def np_activation(act, g, u):
    sig = 0.5 * (1 + np.tanh(g / 2))
    if act.kind == "silu":
        return g * sig * u
    return act.beta * np.tanh(g / act.beta) * sig * act.linear_beta * np.tanh(u / act.linear_beta)


def np_ffn(x, e, ws, act, np_dtype):
    """One row through expert e, in float64 with the model's roundings to the activation dtype."""
    w1, w3, w2 = ws
    rnd = lambda a: a.astype(np_dtype).astype(np.float64)  # noqa: E731
    return rnd(w2[e] @ rnd(np_activation(act, w1[e] @ x, w3[e] @ x)))


def inputs(dtype, rows, seed):
    jdt, ndt = DTYPES[dtype]
    x = np.random.default_rng(seed).standard_normal((rows, D)).astype(ndt)
    return jnp.asarray(x, jdt), x.astype(np.float64)


def run_expert_ffn(impl, *args, activation):
    if impl == "reference":
        return expert_ffn(*args, activation=activation, impl="reference")
    if impl in SPLITS:
        return xla.expert_ffn(*args[:-3], *SPLITS[impl](*args[-3:]), activation=activation)
    return xla.expert_ffn(*args, activation=activation, strategy=impl)


def run_moe_ffn(impl, *args, activation):
    if impl == "reference":
        return moe_ffn(*args, activation=activation, impl="reference")
    if impl in SPLITS:
        return xla.moe_ffn(*args[:-3], *SPLITS[impl](*args[-3:]), activation=activation)
    return xla.moe_ffn(*args, activation=activation, strategy=impl)


def assert_close(got, want, dtype):
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=TOL[dtype] * scale)


MAIN_COMBOS = [("mxfp4", "bf16"), ("plain", "f32")]  # K3 and a Kimi Linear run in f32
ALL_COMBOS = MAIN_COMBOS + [("mxfp4", "f32"), ("plain", "bf16")]


# The weight kind and dtype handling is shared by the strategies: all combinations on the CPU default.
@pytest.mark.parametrize("impl, wkind, dtype", [(i, *c) for i in MOE_IMPLS
                                                for c in (ALL_COMBOS if i in ("loop", *SPLITS) else MAIN_COMBOS)])
def test_moe_ffn_matches_numpy(impl, wkind, dtype):
    ws = weights(wkind)
    np_ws = np_weights(ws, DTYPES[dtype][1])
    # T*k < E (the ragged path then gathers only the active experts); T*k >= E with several rows
    # per expert; every token on expert 5 (seven empty groups)
    for tokens, k, one_expert in [(3, 2, False), (20, 3, False), (12, 1, True)]:
        rng = np.random.default_rng(tokens)
        x, x64 = inputs(dtype, tokens, tokens)
        ids = np.full((tokens, 1), 5) if one_expert else np.stack([rng.choice(E, k, replace=False)
                                                                   for _ in range(tokens)])
        wts = rng.uniform(0, 1, (tokens, k)).astype(np.float32)
        f = jax.jit(lambda *a: run_moe_ffn(impl, *a, activation=SITU))  # weights as arguments, not constants
        out = f(x, jnp.asarray(ids, jnp.int32), jnp.asarray(wts), *ws)
        assert out.dtype == jnp.float32 and out.shape == (tokens, D)
        want = np.array([sum(wts[t, j] * np_ffn(x64[t], ids[t, j], np_ws, SITU, DTYPES[dtype][1]) for j in range(k))
                         for t in range(tokens)])
        assert_close(out, want, dtype)


# (rows, group sizes): empty groups and padding rows past the sum; fewer rows than experts (one-row
# tiles for stacked experts, 4-row ones for split experts; a group of two running the stacked loop past
# its first tile); at most a quarter as many rows as experts (one-row tiles for split experts too, a
# group of two past its first); a group spanning two 16-row tiles (five 4-row ones), the last of which
# slides back over another group's rows; all rows padding
GROUPS = [(9, [2, 0, 3, 0, 0, 1, 0, 1]), (6, [0, 2, 0, 0, 1, 0, 0, 1]), (2, [0, 0, 2, 0, 0, 0, 0, 0]),
          (20, [3, 0, 0, 0, 0, 0, 0, 17]), (5, [0] * 8)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wkind, dtype", MAIN_COMBOS)
def test_expert_ffn_groups_and_padding(impl, wkind, dtype):
    ws = weights(wkind, seed=1)
    np_ws = np_weights(ws, DTYPES[dtype][1])
    for rows, sizes in GROUPS:
        x, x64 = inputs(dtype, rows, rows)
        got = jax.jit(lambda *a: run_expert_ffn(impl, *a, activation=SILU))(x, jnp.asarray(sizes, jnp.int32), *ws)
        assert got.dtype == x.dtype and got.shape == (rows, D)
        experts = np.repeat(np.arange(E), sizes)
        used = len(experts)
        want = np.array([np_ffn(x64[r], experts[r], np_ws, SILU, DTYPES[dtype][1]) for r in range(used)])
        if used:
            assert_close(got[:used], want, dtype)
        np.testing.assert_array_equal(np.asarray(got[used:], np.float32), 0.0)  # padding rows


def test_xla_matches_reference_through_the_public_api():
    ws = weights("mxfp4", seed=2)
    x, _ = inputs("bf16", 16, 3)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, E, (16, 4)), jnp.int32)  # repeats within a token too
    wts = jnp.asarray(np.random.default_rng(4).uniform(0, 1, (16, 4)), jnp.float32)
    f = jax.jit(moe_ffn, static_argnames=("activation", "impl"))  # GatedActivation as a static arg
    got = f(x, ids, wts, *ws, activation=SITU, impl="auto")
    want = f(x, ids, wts, *ws, activation=SITU, impl="reference")
    assert_close(got, np.asarray(want, np.float64), "bf16")


def test_split_experts_through_the_public_api():
    """SplitExperts weights, apart and with gate and up together: "auto" runs the XLA loop, the
    reference stacks them, Pallas refuses them, and splitting then stacking gives back the very
    arrays; a fused gate without its placeholder (or the reverse) is an error that says so."""
    ws = weights("mxfp4", seed=5)
    x, _ = inputs("bf16", 6, 5)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, E, (6, 2)), jnp.int32)
    wts = jnp.asarray(np.random.default_rng(6).uniform(0, 1, (6, 2)), jnp.float32)
    want = moe_ffn(x, ids, wts, *ws, activation=SITU, impl="reference")
    for layout, split_fn in SPLITS.items():
        split = split_fn(*ws)
        assert [s.shape for s in split if not s.is_placeholder] == [w.shape for w in ws if layout == "split" or
                                                                    w is not ws[1]]
        assert all(len(s.experts) == E for s in split if not s.is_placeholder)
        for a, b in zip(jax.tree.leaves(stacked(*split)), jax.tree.leaves(ws)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for impl in ("auto", "reference"):
            assert_close(moe_ffn(x, ids, wts, *split, activation=SITU, impl=impl), np.asarray(want, np.float64),
                         "bf16")
        with pytest.raises(ValueError, match="SplitExperts"):
            moe_ffn(x, ids, wts, *split, activation=SITU, impl="pallas")
        with pytest.raises(ValueError, match="SplitExperts"):
            xla.moe_ffn(x, ids, wts, *split, activation=SITU, strategy="ragged_dot")
    fused, placeholder = split_gate_up(ws[0], ws[1])
    assert fused.gate_up and placeholder.is_placeholder and isinstance(placeholder, SplitExperts)
    for w_gate, w_up in [(fused, split_experts(ws[1])), (split_experts(ws[0]), placeholder)]:
        with pytest.raises(ValueError, match="split together"):
            moe_ffn(x, ids, wts, w_gate, w_up, split_experts(ws[2]), activation=SITU)


def test_dense_gradients_match_ragged_dot():
    """Training differentiates the "dense" strategy: its gradients with respect to the rows, the gate
    weights and every expert weight equal those through lax.ragged_dot (the routed products)."""
    ws = weights("plain")
    x, _ = inputs("f32", 20, 3)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(np.stack([rng.choice(E, 3, replace=False) for _ in range(20)]), jnp.int32)
    wts = jnp.asarray(rng.uniform(0, 1, (20, 3)), jnp.float32)
    probe = jnp.asarray(rng.standard_normal((20, D)), jnp.float32)

    def grads(strategy):
        loss = lambda x, wts, *ws: jnp.sum(probe * xla.moe_ffn(x, ids, wts, *ws, activation=SITU,  # noqa: E731
                                                              strategy=strategy))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, wts, *ws)

    dense = grads("dense")
    for got, want in zip(dense, grads("ragged_dot")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5 * np.abs(want).max())
    assert np.abs(np.asarray(dense[2])).max() > 0


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_no_tokens(impl):
    ws = weights("mxfp4")
    x = jnp.zeros((0, D), jnp.bfloat16)
    out = moe_ffn(x, jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 4)), *ws, activation=SITU, impl=impl)
    assert out.shape == (0, D) and out.dtype == jnp.float32
    assert expert_ffn(x, jnp.zeros((E,), jnp.int32), *ws, activation=SITU, impl=impl).shape == (0, D)


def test_bad_arguments_name_the_problem():
    ws = weights("plain")
    x, ids, wts = jnp.zeros((2, D)), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2))
    with pytest.raises(ValueError, match=r"topk_ids \(3, 2\)"):
        moe_ffn(x, jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)), *ws, activation=SILU)
    with pytest.raises(ValueError, match="integer expert ids"):
        moe_ffn(x, wts, wts, *ws, activation=SILU)
    with pytest.raises(ValueError, match=r"x has shape \(2, 65\)"):
        moe_ffn(jnp.zeros((2, D + 1)), ids, wts, *ws, activation=SILU)
    with pytest.raises(ValueError, match="expert weights disagree"):
        moe_ffn(x, ids, wts, ws[0], ws[0], ws[0], activation=SILU)
    with pytest.raises(ValueError, match=r"group_sizes has shape \(3,\)"):
        expert_ffn(x, jnp.zeros((3,), jnp.int32), *ws, activation=SILU)
    with pytest.raises(ValueError, match="unknown impl 'triton'"):
        moe_ffn(x, ids, wts, *ws, activation=SILU, impl="triton")
    with pytest.raises(ValueError, match="unknown grouped-matmul strategy 'sorted'"):
        xla.moe_ffn(x, ids, wts, *ws, activation=SILU, strategy="sorted")
    with pytest.raises(ValueError, match="'dense' is moe_ffn's alone"):
        xla.expert_ffn(x, jnp.array([2] + [0] * (E - 1)), *ws, activation=SILU, strategy="dense")
