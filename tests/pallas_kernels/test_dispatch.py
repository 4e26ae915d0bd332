"""How ops choose their implementation, and the Pallas kernels run per shard under a mesh (interpret
mode on 4 of the 16 fake CPU devices: model=2 x data=2) against their references without one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import dispatch, mla
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda
from pallas_kernels.kda_decode import kda_decode
from sharding.mesh import make_mesh
from tests.pallas_kernels import test_kda_decode, test_kda_pallas, test_mla_kernels


@pytest.fixture
def mesh():
    return make_mesh("2x2")


def test_auto_follows_the_backend_and_the_environment(monkeypatch):
    assert not dispatch.on_gpu()  # the CPU test suite
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert dispatch.resolve("auto", True, "") == "xla"
    monkeypatch.setenv(dispatch.ENV, "pallas")
    assert dispatch.resolve("auto", True, "") == "pallas"
    assert dispatch.resolve("auto", False, "") == "xla"  # shapes the kernel does not take
    assert dispatch.resolve("reference", True, "") == "reference"  # an explicit impl wins
    monkeypatch.setenv(dispatch.ENV, "xla")
    assert dispatch.resolve("auto", True, "") == "xla"
    monkeypatch.setenv(dispatch.ENV, "triton")
    with pytest.raises(ValueError, match="K3JAX_KERNELS='triton'"):
        dispatch.resolve("auto", True, "")
    with pytest.raises(ValueError, match=r"does not take these shapes \(q \(1, 24\)\)"):
        dispatch.resolve("pallas", False, "q (1, 24)")
    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        dispatch.resolve("cuda", True, "")


def test_per_shard_gives_each_device_its_heads_and_rows(mesh):
    seen = []

    def kernel(x, table, factor):
        seen.append((x.shape, table.shape, factor))
        return x * factor + table.sum(), x[:, :, 0]

    x = jnp.arange(4 * 6 * 2, dtype=jnp.float32).reshape(4, 6, 2)  # [rows, tokens, heads]
    table = jnp.arange(3.0)
    roles = (("rows", None, "heads"), None, None)
    want = kernel(x, table, 2.0)
    seen.clear()
    with jax.set_mesh(mesh):
        got = jax.jit(lambda x, t: dispatch.per_shard(kernel, (x, t, 2.0), roles,
                                                      (("rows", None, "heads"), ("rows", None))))(x, table)
    assert seen == [((2, 6, 1), (3,), 2.0)]  # traced once, for one shard; the number stays a number
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # A dimension the mesh does not divide stays whole.
    seen.clear()
    with jax.set_mesh(mesh):
        jax.jit(lambda x: dispatch.per_shard(kernel, (x, table, 1.0), roles, (roles[0], ("rows", None))))(x[:3])
    assert seen == [((3, 6, 1), (3,), 1.0)]


def _under_mesh(mesh, fn, *args, shardings):
    """fn(*args) jitted under the mesh, with the arguments placed as the model places them."""
    placed = [jax.device_put(a, NamedSharding(mesh, s)) if s is not None else a for a, s in zip(args, shardings)]
    with jax.set_mesh(mesh):
        return jax.jit(fn)(*placed)


HEADS_4D = P(None, None, "model", None)


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_kda_kernels_per_shard(mesh, op):
    cu, s0, inputs = test_kda_pallas.packed([5, 64, 70], seed=3)
    q, k, v, g, beta = test_kda_pallas.f32(*inputs)
    s0, cu = jnp.asarray(s0, jnp.float32), jnp.asarray(cu)
    kw = {"cu_seqlens": cu, "output_final_state": True}

    def run(q, k, v, g, beta, s0):
        return op(q, k, v, g, beta, initial_state=s0, impl="pallas", **kw)

    got = _under_mesh(mesh, run, q, k, v, g, beta, s0,
                      shardings=[HEADS_4D] * 4 + [P(None, None, "model"), P(None, "model")])
    want = op(q, k, v, g, beta, initial_state=s0, impl="reference", **kw)
    for g_, w in zip(got, want):
        test_kda_pallas.assert_close(g_, w, test_kda_pallas.FP32_REL)


@pytest.mark.parametrize("return_states", [False, True])
def test_kda_decode_per_shard(mesh, return_states):
    args = test_kda_decode.make_inputs(2, seed=7)
    heads = functools.partial(P, None, None, None, "model")
    shardings = [heads(), P(None, None, "model"), heads(), P(None, None, "model"), P("model"), P("model"),
                 P(None, None, "model"), P(None, "model"), P()]

    def run(*args):
        return kda_decode(*args, gate_lower_bound=test_kda_decode.K3_GATE, return_states=return_states,
                          impl="pallas")

    got = _under_mesh(mesh, run, *args, shardings=shardings)
    want = kda_decode(*args, gate_lower_bound=test_kda_decode.K3_GATE, return_states=return_states,
                      impl="reference")
    if return_states:
        real = test_kda_decode.REAL
        test_kda_decode.assert_close(got[0][real], want[0][real], test_kda_decode.BF16_REL)
        test_kda_decode.assert_close(got[1][real], want[1][real], test_kda_decode.STATE_REL)
    else:
        test_kda_decode.assert_same_step(got, want)


def test_mla_prefill_per_shard(mesh):
    mlak = test_mla_kernels
    q, k, v = mlak.padded_inputs(jnp.float32, b=4)
    offsets, lengths = jnp.asarray([16, 0, -5, 3]), jnp.asarray([53, 37, 20, 40])

    def run(q, k, v, offsets, lengths):
        return mla.causal_attention(q, k, v, q_offset=offsets, kv_length=lengths, scale=0.2, impl="pallas",
                                    **mlak.SMALL_BLOCKS)

    rows_heads = P("data", None, "model", None)
    got = _under_mesh(mesh, run, q, k, v, offsets, lengths, shardings=[rows_heads] * 3 + [P("data")] * 2)
    want = mlak.reference.causal_attention(q, k, v, q_offset=offsets, kv_length=lengths, scale=0.2)
    mlak.assert_mix_close(got, want, v, jnp.float32)

    q, k, v, cu_q, cu_k = mlak.packed_inputs(jnp.float32, mlak.Q_LENS, mlak.K_LENS)
    kw = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "scale": 0.2}

    def run_packed(q, k, v):
        return mla.varlen_causal_attention(q, k, v, impl="pallas", **mlak.SMALL_BLOCKS, **kw)

    got = _under_mesh(mesh, run_packed, q, k, v, shardings=[P(None, "model", None)] * 3)
    mlak.assert_mix_close(got, mlak.reference.varlen_causal_attention(q, k, v, **kw), v, jnp.float32)


def test_mla_paged_decode_per_shard(mesh):
    mlak = test_mla_kernels
    kv_scale = jnp.float32(0.25)
    q, pages, table, lengths, _ = mlak.paged_inputs(16, [1, 32, 45, 80], heads=4, pages_dtype=jnp.float8_e4m3fn,
                                                    kv_scale=0.25)
    kw = {"scale": 0.1, "value_width": 64}

    def run(q, pages, table, lengths, kv_scale):
        return mla.paged_decode_attention(q, pages, table, lengths, kv_scale=kv_scale, impl="pallas",
                                          **mlak.SMALL_SPLITS, **kw)

    got = _under_mesh(mesh, run, q, pages, table, lengths, kv_scale,
                      shardings=[P("data", "model", None), P(), P("data", None), P("data"), P()])
    want = mlak.reference.paged_decode_attention(q, pages, table, lengths, kv_scale=kv_scale, **kw)
    mlak.assert_mix_close(got, want, pages[1:, :, :64].astype(jnp.float32) * 0.25, jnp.bfloat16)

