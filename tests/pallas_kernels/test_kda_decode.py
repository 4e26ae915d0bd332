"""The KDA decode step over slot pools: the reference against the model's own composition (its conv,
the layer's gates, the KDA op's reference recurrence), the XLA path and the Pallas kernel (interpret
mode) against the reference, speculative windows (per-position states, commit of an accepted prefix),
and lowering of the kernel to Triton for an H200 and an MI300 at K3's shapes, pools aliased."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.kda import _causal_conv_silu
from pallas_kernels.kda import fused_recurrent_kda
from pallas_kernels.kda_decode import commit_accepted, kda_decode, pallas_triton
from tests.pallas_kernels.gpu_lowering import lower_for_gpu, triton_call_count

H, D, W = 2, 64, 4  # D = 64: two [D, 32] state tiles per head in the kernel
NUM_SLOTS = 9
SLOTS = [5, 0, 2, 7, 0, 3]  # arbitrary order, two padding rows on the null slot
REAL = np.array(SLOTS) != 0
UNUSED = np.array([1, 4, 6, 8])
K3_GATE = -5.0

# Every path computes in fp32. fp32 state: a few rounding steps of 6e-8 on sums of D terms over
# T <= 4 tokens, far below 1e-5 of the largest value. o is rounded to bf16 in the end, so sums that
# differ in the last fp32 bit may round one bf16 step apart: 2^-8 of a value, 2^-7 leaves a margin.
STATE_REL = 1e-5
BF16_REL = 2.0 ** -7


def make_inputs(t, dtype=jnp.bfloat16, seed=0):
    """Arguments of kda_decode (before the keywords), slot 0 filled with NaN: garbage that no real
    row may see."""
    rng = np.random.default_rng(seed)
    n, p = len(SLOTS), H * D

    def normal(*shape, scale=1.0):
        return scale * rng.standard_normal(shape)

    conv_pool = normal(NUM_SLOTS, W - 1, 3, p)
    state_pool = normal(NUM_SLOTS, H, D, D, scale=0.3)
    conv_pool[0] = state_pool[0] = np.nan
    return (jnp.asarray(normal(n, t, 3, p), dtype), jnp.asarray(normal(W, 3, p, scale=0.5), jnp.float32),
            jnp.asarray(conv_pool, dtype), jnp.asarray(normal(n, t, p), jnp.float32),
            jnp.asarray(normal(p), jnp.float32), jnp.asarray(normal(H), jnp.float32),
            jnp.asarray(normal(n, t, H), dtype), jnp.asarray(state_pool, jnp.float32),
            jnp.asarray(SLOTS, jnp.int32))


def assert_close(actual, expected, rel):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * np.abs(expected).max())


def assert_same_step(result, expected):
    """Real rows' outputs and slots match; the slots nobody uses are untouched, bit for bit."""
    (o, conv, state), (ref_o, ref_conv, ref_state) = result, expected
    real_slots = np.array(SLOTS)[REAL]
    assert_close(o[REAL], ref_o[REAL], BF16_REL)
    assert_close(state[real_slots], ref_state[real_slots], STATE_REL)
    for slots in (real_slots, UNUSED):
        np.testing.assert_array_equal(np.asarray(conv[slots], np.float32), np.asarray(ref_conv[slots], np.float32))
    np.testing.assert_array_equal(state[UNUSED], ref_state[UNUSED])


def spec_log_decay(f, dt_bias, a_log, lower_bound):
    """Spec 2.4, written out again: s = f + dt_bias per channel, A = exp(A_log) per head."""
    s = (f + dt_bias).reshape(*f.shape[:-1], H, D)
    a = jnp.exp(a_log)[:, None]
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(a * s)
    return -a * jnp.where(s > 20.0, s, jnp.log1p(jnp.exp(s)))


@pytest.mark.parametrize("gate", [K3_GATE, None], ids=["safe_gate", "softplus_gate"])
@pytest.mark.parametrize("t", [1, 4])
def test_reference_is_the_model_composition(t, gate):
    args = make_inputs(t, jnp.float32, seed=t)  # fp32: no bf16 rounding of the conv output to disagree on
    qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, _ = args
    o, conv, state = kda_decode(*args, gate_lower_bound=gate, impl="reference")

    rows = np.array(SLOTS)[REAL]
    window = jnp.concatenate([conv_pool[rows], qkv[REAL]], axis=1)  # the layer's window [N, W-1+T, 3, P]
    u = _causal_conv_silu(window, conv_weight, t)
    q, k, v = (u[:, :, c].reshape(-1, t, H, D) for c in range(3))
    g = spec_log_decay(f[REAL], dt_bias, a_log, gate)
    beta = jax.nn.sigmoid(beta_logits[REAL])
    ref_o, ref_state = fused_recurrent_kda(q, k, v, g, beta, initial_state=state_pool[rows], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, impl="reference")
    assert_close(o[REAL], ref_o, STATE_REL)  # fp32 throughout
    assert_close(state[rows], ref_state, STATE_REL)
    np.testing.assert_array_equal(conv[rows], window[:, t:])


# Interpret mode is slow to trace: the Pallas kernel takes both gates at T = 1 and the safe one at T = 4.
@pytest.mark.parametrize(("impl", "t", "gate"), [("xla", 1, K3_GATE), ("xla", 1, None), ("xla", 4, K3_GATE),
                                                 ("xla", 4, None), ("pallas", 1, K3_GATE), ("pallas", 1, None),
                                                 ("pallas", 4, K3_GATE)])
def test_matches_reference_with_padding_rows_and_shuffled_slots(impl, t, gate):
    args = make_inputs(t, seed=10 + t)
    expected = kda_decode(*args, gate_lower_bound=gate, impl="reference")
    assert_same_step(kda_decode(*args, gate_lower_bound=gate, impl=impl), expected)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_single_token_steps_equal_one_window(impl):
    t = 4
    qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots = make_inputs(t, seed=3)
    o_window, conv_window, state_window = kda_decode(qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits,
                                                     state_pool, slots, gate_lower_bound=K3_GATE, impl=impl)
    outputs = []
    for i in range(t):
        o, conv_pool, state_pool = kda_decode(qkv[:, i:i + 1], conv_weight, conv_pool, f[:, i:i + 1], dt_bias, a_log,
                                              beta_logits[:, i:i + 1], state_pool, slots, gate_lower_bound=K3_GATE,
                                              impl=impl)
        outputs.append(o)
    assert_same_step((jnp.concatenate(outputs, axis=1), conv_pool, state_pool), (o_window, conv_window, state_window))


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_states_per_position_and_commit_of_an_accepted_prefix(impl):
    t = 4
    args = make_inputs(t, seed=4)
    qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots = args
    o, states = kda_decode(*args, gate_lower_bound=K3_GATE, return_states=True, impl=impl)
    assert states.shape == (len(SLOTS), t, H, D, D) and states.dtype == jnp.float32
    o_ref, states_ref = kda_decode(*args, gate_lower_bound=K3_GATE, return_states=True, impl="reference")
    assert_close(o[REAL], o_ref[REAL], BF16_REL)
    assert_close(states[REAL], states_ref[REAL], STATE_REL)

    # Rows accept 1 to T tokens; each committed slot must equal a plain step over that prefix.
    accepted = jnp.asarray([2, 1, 4, 1, 3, 3], jnp.int32)
    conv, state = commit_accepted(conv_pool, state_pool, slots, qkv, states, accepted)
    for a in sorted(set(np.asarray(accepted)[REAL].tolist())):
        prefix = (qkv[:, :a], conv_weight, conv_pool, f[:, :a], dt_bias, a_log, beta_logits[:, :a], state_pool, slots)
        _, ref_conv, ref_state = kda_decode(*prefix, gate_lower_bound=K3_GATE, impl="reference")
        rows = np.array(SLOTS)[REAL & (np.asarray(accepted) == a)]
        assert_close(state[rows], ref_state[rows], STATE_REL)
        np.testing.assert_array_equal(np.asarray(conv[rows], np.float32), np.asarray(ref_conv[rows], np.float32))
    np.testing.assert_array_equal(state[UNUSED], state_pool[UNUSED])


def test_auto_is_xla_off_gpu():
    args = make_inputs(1, seed=5)
    for auto, xla in zip(kda_decode(*args, impl="auto"), kda_decode(*args, impl="xla")):
        np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(xla, np.float32))


def test_bad_arguments_name_the_argument():
    args = list(make_inputs(1))
    cases = {"qkv": (0, args[0][:, :, :2]), "conv_weight": (1, args[1][:, :, :D]), "conv_pool": (2, args[2][:, :2]),
             "f": (3, args[3][:, :, :D]), "A_log": (5, args[5][:, None]), "beta_logits": (6, args[6][:, :, :1]),
             "state_pool": (7, args[7].astype(jnp.bfloat16)), "slots": (8, args[8].astype(jnp.float32))}
    for name, (index, bad) in cases.items():
        with pytest.raises(ValueError, match=name):
            kda_decode(*args[:index], bad, *args[index + 1:])
    with pytest.raises(ValueError, match="impl"):
        kda_decode(*args, impl="triton")
    states = jnp.zeros((len(SLOTS), 1, H, D, D))
    with pytest.raises(ValueError, match="accepted"):
        commit_accepted(args[2], args[7], args[8], args[0], states, jnp.ones((2,), jnp.int32))


# K3 at TP8: 12 heads of 128, 64 rows, W = 4, bf16 activations and conv pool, fp32 states.
K3_HEADS, K3_DIM, K3_ROWS = 12, 128, 64


def k3_shapes(t):
    p, s = K3_HEADS * K3_DIM, K3_ROWS + 1
    sd = jax.ShapeDtypeStruct
    return (sd((K3_ROWS, t, 3, p), jnp.bfloat16), sd((W, 3, p), jnp.float32), sd((s, W - 1, 3, p), jnp.bfloat16),
            sd((K3_ROWS, t, p), jnp.float32), sd((p,), jnp.float32), sd((K3_HEADS,), jnp.float32),
            sd((K3_ROWS, t, K3_HEADS), jnp.bfloat16), sd((s, K3_HEADS, K3_DIM, K3_DIM), jnp.float32),
            sd((K3_ROWS,), jnp.int32))


@pytest.mark.parametrize(("return_states", "gate"), [(False, K3_GATE), (True, K3_GATE), (False, None)],
                         ids=["commit", "states", "commit_softplus_gate"])
@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_to_triton_at_k3_shapes_with_pools_aliased(platform, t, return_states, gate):
    def step(*args):
        return pallas_triton.kda_decode(*args, gate_lower_bound=gate, return_states=return_states)

    text = lower_for_gpu(step, *k3_shapes(t), platform=platform)
    assert triton_call_count(text) == 1
    # The kernel's inputs 4 (conv_pool) and 8 (state_pool) are its outputs 1 and 2: updated in place.
    aliases = [f"output_tuple_indices = [{out}], operand_index = {arg}," for out, arg in ((1, 4), (2, 8))]
    assert all((alias in text) != return_states for alias in aliases)


def test_donated_pools_are_updated_in_place_by_the_xla_path():
    args = make_inputs(1, seed=6)
    step = jax.jit(lambda *a: kda_decode(*a, gate_lower_bound=K3_GATE, impl="xla"), donate_argnums=(2, 7))
    compiled = step.lower(*args).compile().as_text()
    assert compiled.count("may-alias") + compiled.count("must-alias") == 2, "both pools should alias their outputs"
