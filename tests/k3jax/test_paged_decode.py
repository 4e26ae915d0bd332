"""The engine's paged forward (KDA states in slots, MLA rows in pages, decode steps through the KDA
decode op) against the full causal forward, from pools full of garbage; and the same steps with every
Pallas kernel (interpret mode) run per shard on a model=2 mesh, and per data group on 2x2 (DP
attention), against the XLA paths on one device."""

import contextlib
import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import K3Config
from k3jax.decoder import PagedState, init_pools
from k3jax.model import K3Model
from pallas_kernels import dispatch
from sharding.mesh import make_mesh
from tests.agreement import Referee
from tests.k3jax.tiny_configs import k3_tiny_dict

PAGE, PAGES, SLOTS, WIDTH = 16, 12, 5, 3  # page size (the Pallas decode's smallest), pages, slots, table width
PROMPTS = [[7, 3, 9, 1, 4, 4, 2], [11]]  # the second is a one-token prompt: a "decode" step on a fresh slot
SLOT_OF = [3, 1]
STEPS = 4


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, groups, params, pools, tokens, lengths, offsets, slots, table):
    out = nnx.merge(graphdef, params).step(tokens, lengths, PagedState(pools, offsets, slots, table, groups))
    return out.logits, out.state.layers


def garbage_pools(cfg, dtype, groups: int = 1):
    """Pools whose every slot and page holds large random values, as left behind by other requests
    (with DP attention's `groups`, a block of SLOTS slots and PAGES pages for each)."""
    pools = init_pools(cfg, num_slots=SLOTS * groups, num_pages=PAGES * groups, page_size=PAGE, dtype=dtype)
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda a: jnp.asarray(10 * rng.standard_normal(a.shape), a.dtype), pools)


def run_steps(model, pools, feed=None, groups: int = 1):
    """Prefills prompt 0 (7 tokens) beside a padding row; then decodes row 0 while row 1 brings its
    one-token prompt to a fresh slot; then decodes both greedily, or with the tokens of `feed` (the
    sequences of another run: teacher forcing). Every call has 2 rows (2 compiles). With 2 `groups`
    (DP attention) row r runs in group r, its slot and pages the same ids within its group's block.
    Returns each call's last-token logits [2, V] and the token sequences fed."""
    sequences = [[], []]
    tables = np.array([[1 + 3 * s + j for j in range(WIDTH)] for s in SLOT_OF], np.int32)
    logits_seen = []

    def call(new_tokens):
        """Feeds each row its new tokens (after those of sequences[r] already cached) and appends them."""
        nonlocal pools
        tokens = np.zeros((2, max(len(t) for t in new_tokens)), np.int32)
        for r, t in enumerate(new_tokens):
            tokens[r, :len(t)] = t
        lengths = np.array([len(t) for t in new_tokens], np.int32)
        offsets = np.array([len(seq) for seq in sequences], np.int32)
        slots = np.where(lengths > 0, SLOT_OF, 0).astype(np.int32)  # a padding row: the null slot and page
        logits, pools = _forward(model.graphdef, groups, model.params, pools, tokens, lengths, offsets, slots,
                                 tables * (lengths > 0)[:, None])
        for seq, t in zip(sequences, new_tokens):
            seq.extend(t)
        last = np.asarray(logits)[np.arange(2), np.maximum(lengths - 1, 0)]
        logits_seen.append(last)
        if feed is None:
            return [int(t) for t in last.argmax(-1)]
        return [seq[len(fed)] if len(fed) < len(seq) else None for fed, seq in zip(sequences, feed)]

    with jax.set_mesh(model.mesh) if model.mesh is not None else contextlib.nullcontext():
        first = call([PROMPTS[0], []])[0]
        following = call([[first], PROMPTS[1]])
        for _ in range(STEPS):
            following = call([[t] for t in following])
    return logits_seen, sequences


def check_against_reference(referee, logits_seen, sequences, what):
    """Each call's logits of each row are the full forward's at that position (one device, fp32's
    tolerance, router near-ties followed: tests/agreement.py)."""
    for r in range(2):
        calls = logits_seen if r == 0 else logits_seen[1:]  # row 1 joins in the second call
        positions = len(PROMPTS[r]) - 1 + np.arange(len(calls))
        referee.check_logits(sequences[r][:positions[-1] + 1], np.stack([c[r] for c in calls]), positions,
                             what=f"{what}, row {r}")


def pallas_sized_config():
    """k3-tiny with MLA widths the Pallas kernels take: qk 16 + 16, latent 32 + 16 (C = 48)."""
    cfg = copy.deepcopy(k3_tiny_dict())
    cfg["text_config"]["qk_rope_head_dim"] = 16
    return K3Config.from_hf_dict(cfg)


@pytest.fixture(scope="module")
def xla_run():
    """The XLA paths on one device: (model, logits of every call, sequences)."""
    model = K3Model.random(pallas_sized_config(), dtype="float32", seed=0)
    return model, *run_steps(model, garbage_pools(model.config, jnp.float32))


def test_paged_steps_from_garbage_pools_match_the_full_forward(xla_run):
    # cached decode reassociates against the full forward (absorbed MLA, token-by-token KDA)
    model, logits_seen, sequences = xla_run
    check_against_reference(Referee(model), logits_seen, sequences, "XLA paged steps")


def test_pallas_kernels_per_shard_match_the_xla_paths(xla_run, monkeypatch):
    # fp32, summed in other orders (the kernels' blocked dots and split pages, one row per data shard),
    # fed the XLA run's tokens: both against the full forward
    model, _, sequences = xla_run
    monkeypatch.setenv(dispatch.ENV, "pallas")
    sharded = K3Model(model.config, model.graphdef, model.params, make_mesh("2x1"))
    got, fed = run_steps(sharded, garbage_pools(model.config, jnp.float32), feed=sequences)
    assert fed == sequences
    check_against_reference(Referee(model), got, fed, "Pallas paged steps per shard")


@pytest.mark.isa_covered  # the kernels of test_pallas_kernels_per_shard_match_the_xla_paths
def test_pallas_kernels_per_data_group_match_the_xla_paths(xla_run, monkeypatch):
    # DP attention on 2x2: each data group's rows and pool blocks on its own devices (data manual),
    # the Pallas kernels per shard inside it over model: what a GPU mesh with data > 1 runs
    model, _, sequences = xla_run
    monkeypatch.setenv(dispatch.ENV, "pallas")
    sharded = K3Model(model.config, model.graphdef, model.params, make_mesh("2x2"))
    got, fed = run_steps(sharded, garbage_pools(model.config, jnp.float32, groups=2), feed=sequences, groups=2)
    assert fed == sequences
    check_against_reference(Referee(model), got, fed, "Pallas paged steps per data group")
