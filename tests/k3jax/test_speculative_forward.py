"""The decoder's speculative pieces (fp32): a recorded verify window plus `commit_record` leaves every
KDA slot exactly as a plain decode of the accepted tokens would, and tapped hidden states equal the
residual stream / AttnRes mixture computed layer by layer.

The models route every token to the same experts by wide margins (`K3Model.with_fixed_routing`): the paths
compared here (a window against token-by-token decodes, eager layers against the jitted forward) add
in other orders, and the random routers' near-ties would let rounding send a token to other experts
in one of them (issue 19)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import decoder
from k3jax.decoder import Batch, PagedState, TapSpec, init_pools
from k3jax.layers import attn_res
from k3jax.layers.kda import KDACache, commit_record
from k3jax.model import K3Model
from tests.k3jax.tiny_configs import k3_tiny, kimi_linear_tiny

PAGE, PAGES, SLOTS, WIDTH = 4, 24, 4, 8  # page size, pages, KDA slots, page-table width


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def model(request):
    cfg = k3_tiny() if request.param == "k3-tiny" else kimi_linear_tiny()
    return K3Model.random(cfg, dtype="float32", seed=0).with_fixed_routing()


@functools.partial(jax.jit, static_argnums=0, static_argnames="verify")
def _forward(graphdef, params, pools, tokens, lengths, offsets, slots, table, *, verify=False):
    module, state = nnx.merge(graphdef, params), PagedState(pools, offsets, slots, table)
    return module.verify(tokens, lengths, state) if verify else module.step(tokens, lengths, state)


def _call(model, pools, rows, **kw):
    """rows: (tokens, offset, slot) each; every row uses pages 1 + slot * 6 ... (disjoint)."""
    width = max(len(t) for t, _, _ in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, (t, _, _) in enumerate(rows):
        tokens[i, :len(t)] = t
    lengths = np.array([len(t) for t, _, _ in rows], np.int32)
    offsets = np.array([o for _, o, _ in rows], np.int32)
    slots = np.array([s for _, _, s in rows], np.int32)
    table = np.array([[1 + s * 6 + j if j < 6 else 0 for j in range(WIDTH)] for s in slots], np.int32)
    return _forward(model.graphdef, model.params, pools, tokens, lengths, offsets, slots, table, **kw)


def _kda_pools(layers):
    return [c for c in layers if isinstance(c, KDACache)]


def test_commit_after_a_verify_window_equals_decoding_the_accepted_tokens(model):
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 9)]
    windows = [rng.integers(0, cfg.vocab_size, 6).tolist() for _ in prompts]
    accepted = np.array([2, 6], np.int32)  # a partial acceptance, and the whole window
    pools = init_pools(cfg, num_slots=SLOTS, num_pages=PAGES, page_size=PAGE, dtype=jnp.float32)
    _, state, _ = _call(model, pools, [(p, 0, 1 + i) for i, p in enumerate(prompts)])
    prefilled = state.layers

    logits, verified, _, records = _call(model, jax.tree.map(jnp.copy, prefilled),
                                         [(w, len(p), 1 + i) for i, (p, w) in enumerate(zip(prompts, windows))],
                                         verify=True)
    for before, after in zip(_kda_pools(prefilled), _kda_pools(verified.layers)):  # the slots are untouched
        np.testing.assert_array_equal(np.asarray(before.state), np.asarray(after.state))
    slots = jnp.array([1, 2], jnp.int32)
    committed = [commit_record(pool, record, slots, jnp.asarray(accepted))
                 for pool, record in zip(verified.layers, records) if record is not None]

    decoded = prefilled  # the reference: one plain decode step per accepted token
    for i, (prompt, window) in enumerate(zip(prompts, windows)):
        for j in range(accepted[i]):
            step_logits, state, _ = _call(model, decoded, [([window[j]], len(prompt) + j, 1 + i)])
            decoded = state.layers
            # the window's MLA runs the naive form, a decode the absorbed one: reassociation, ~1e-6 per layer
            np.testing.assert_allclose(np.asarray(logits[i, j]), np.asarray(step_logits[0, 0]), rtol=1e-4,
                                       atol=1e-4, err_msg=f"row {i} window position {j}")
    # The layers' inputs carry the MLA reassociation above (relative eps_in ~1e-6 per layer, compounding
    # over the layers: the logits differ by up to 4e-5), so the states agree to that level here; given
    # equal layer inputs they agree to fp32 rounding (the next test). A KDA step S <- (I - b k k^T) diag(a) S
    # + b k v^T passes its inputs' relative error to S normwise: ||k|| = 1 (l2-normed), 0 <= a, b <= 1, so
    # the transition does not grow S, and each of the window's t <= 6 tokens adds about 3 eps_in ||S|| (k
    # twice, v once): ||dS|| <~ 20 eps_in ||S|| per head. Not entry by entry: an entry that cancels larger
    # terms (layer 6's S[4, 4, 3] = 0.145 in a head of norm 2.2) carries the head's absolute error, and which
    # entry that is depends on XLA:CPU's rounding (jax 0.12.0: 1.7e-5 there, 0.12.1: 4.9e-5, past an
    # entrywise 3e-5 + 1e-4 relative). So each head is compared by norm, at the logits' 1e-4 (measured
    # 1.3e-5 on 0.12.0, 3.5e-5 on 0.12.1).
    for got, want in zip(committed, _kda_pools(decoded)):
        for slot in (1, 2):
            got_s, want_s = np.asarray(got.state[slot]), np.asarray(want.state[slot])  # [H, K, V]
            error = np.linalg.norm(got_s - want_s, axis=(1, 2)) / np.linalg.norm(want_s, axis=(1, 2))
            assert error.max() < 1e-4, f"slot {slot}: the heads' states differ by {error} of their norms"
            np.testing.assert_allclose(np.asarray(got.conv[slot]), np.asarray(want.conv[slot]),
                                       rtol=1e-4, atol=1e-4)


def test_commit_is_a_token_by_token_decode_of_the_same_layer_inputs(model):
    cfg = model.config
    module = nnx.merge(model.graphdef, model.params)
    first_kda = next(i for i, (attn, _) in enumerate(cfg.layer_kinds()) if attn == "kda")
    layer = module.layers[first_kda].self_attn
    rng = np.random.default_rng(2)
    window, rows = 6, 3
    x = jnp.asarray(rng.standard_normal((rows, window, cfg.hidden_size)), jnp.float32)
    pool = KDACache(jnp.asarray(rng.standard_normal((rows + 1, cfg.kda_conv_size - 1, 3, cfg.kda_projection_size)),
                                jnp.float32),
                    jnp.asarray(0.1 * rng.standard_normal((rows + 1, cfg.kda_num_heads, cfg.kda_head_dim,
                                                           cfg.kda_head_dim)), jnp.float32))
    slots = jnp.arange(1, rows + 1, dtype=jnp.int32)
    accepted = jnp.array([1, 4, window], jnp.int32)

    def batch(t, record):
        return Batch(jnp.ones((rows, t), bool), jnp.full((rows,), t, jnp.int32), jnp.full((rows,), 9, jnp.int32),
                     slots, None, record)

    _, recorded = jax.jit(lambda x: layer(x, pool, batch(window, True)))(x)
    committed = jax.jit(commit_record)(recorded.pool, recorded.record, slots, accepted)
    step = jax.jit(lambda x, pool: layer(x, pool, batch(1, False))[1])
    for i in range(rows):
        decoded = pool
        for j in range(int(accepted[i])):
            decoded = step(x[:, j:j + 1], decoded)
        # fp32 to the last few ulps: the window's projections are one [T]-row matmul, the decodes
        # T one-row ones, and XLA blocks (so rounds) them differently; measured max 1.8e-7 (state),
        # 6e-7 (conv window)
        for got, want in ((committed.state, decoded.state), (committed.conv, decoded.conv)):
            np.testing.assert_allclose(np.asarray(got[1 + i]), np.asarray(want[1 + i]), rtol=1e-5, atol=1e-6)


def _layer_by_layer(model, tokens):
    """Each decoder layer called on its own (no taps): the residual stream and the attention input
    after every layer, and the final read."""
    cfg = model.config
    module = nnx.merge(model.graphdef, model.params)
    b, t = tokens.shape
    batch = Batch(jnp.ones((b, t), bool), jnp.full((b,), t, jnp.int32), jnp.zeros((b,), jnp.int32))
    x = jnp.take(module.embed_tokens[...], tokens, axis=0)
    stream = attn_res.start_stream(x, cfg.num_attn_res_blocks) if cfg.attn_res else x
    residual, attention_input = [], []
    for i, layer in enumerate(module.layers):
        stream, _, mix = layer(stream, i, None, batch)
        attention_input.append(mix)
        if cfg.attn_res:
            residual.append(stream.bank.sum(axis=2) + stream.p + stream.d)
        else:
            residual.append(stream)
    final = attn_res.final_read(stream, module.output_attn_res, cfg.rms_norm_eps) if cfg.attn_res else stream
    return residual, attention_input[1:] + [final]


@pytest.mark.parametrize("kind", decoder.TAP_KINDS)
def test_taps_are_the_hidden_states_after_the_listed_layers(model, kind):
    cfg = model.config
    layers = (cfg.num_hidden_layers - 1, 0, 2)  # any order; the last layer included
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    module = nnx.merge(model.graphdef, model.params)
    logits, taps = module.forward(jnp.asarray(tokens), taps=TapSpec(layers, kind))
    residual, next_input = _layer_by_layer(model, jnp.asarray(tokens))
    want = residual if kind == "residual_sum" else next_input
    expected = np.concatenate([np.asarray(want[i]) for i in layers], axis=-1)
    # eager layers against the jitted scan: fp32 reassociation, relative to the streams' scale (~10)
    np.testing.assert_allclose(np.asarray(taps), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    plain = module.forward(jnp.asarray(tokens)).logits
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))  # tapping changes nothing else


def test_unknown_tap_kind_is_refused():
    with pytest.raises(ValueError, match="tap kind 'middle'"):
        TapSpec((0,), "middle")
