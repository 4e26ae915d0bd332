"""The DSpark draft stage (k3jax/train/draft.py): its distillation targets, its training, its export."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from convert import export
from k3jax.config import K3Config
from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.loading import load_draft
from k3jax.dspark.model import DSparkDraft, init_draft_pages, inject_context, propose, shared_head
from k3jax.model import K3Model
from k3jax.presets import DRAFT_PRESETS
from k3jax.train import draft

NEW_TOKENS = 12
PADDED = 32  # every reference forward's length: the longest prompt (14) and its NEW_TOKENS fit


@pytest.fixture(scope="module")
def setup():
    target = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)
    cfg = DSparkConfig.from_dict(DRAFT_PRESETS["k3-tiny-dspark"])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 14, 11, 6)]
    rows = draft.continuations(target, prompts, NEW_TOKENS, batch=4)
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    lengths = np.array([len(r) for r in rows], np.int32)
    data = draft.Distillation(tokens, lengths, np.array([len(p) for p in prompts], np.int32),
                              draft.target_taps(target, cfg, tokens, lengths, batch=4))
    return target, cfg, prompts, data


def test_labels_are_the_targets_greedy_tokens_at_each_offset(setup):
    target, cfg, prompts, data = setup
    k = cfg.block_size
    for row, prompt in enumerate(prompts):
        greedy = list(prompt)  # the reference: the full forward over the whole sequence, one token at a time
        for _ in range(NEW_TOKENS):  # padded to one length (one compile), its real length given
            padded = np.zeros((1, PADDED), np.int32)
            padded[0, :len(greedy)] = greedy
            greedy.append(int(np.argmax(target.logits(padded, [len(greedy)])[0, len(greedy) - 1])))
        assert data.tokens[row, :data.lengths[row]].tolist() == greedy
        anchors = np.arange(len(prompt), len(greedy) - 1, dtype=np.int32)[None]
        labels, weights = draft.distillation_labels(jnp.asarray(data.tokens[row:row + 1]),
                                                    jnp.asarray(data.lengths[row:row + 1]), jnp.asarray(anchors), k)
        for a, p in enumerate(anchors[0]):
            for j in range(k):
                if p + 1 + j < len(greedy):
                    assert weights[0, a, j] == 1 and labels[0, a, j] == greedy[p + 1 + j]
                else:
                    assert weights[0, a, j] == 0


def test_a_short_training_run_lowers_the_loss(setup):
    target, cfg, _, data = setup
    head = shared_head(target)
    batch = draft.sample_anchors(np.random.default_rng(5), data, 4, 8)
    options = draft.DraftOptions(steps=12, batch=4, anchors=8, warmup=2)
    trained, history = draft.train(cfg, head, data, options, log=None)
    start = DSparkDraft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(options.seed))
    before = float(draft.distillation_loss(start, head, *batch)[0])
    after = float(draft.distillation_loss(trained, head, *batch)[0])
    assert after < before - 0.5
    assert len(history["loss"]) == options.steps


def test_the_exported_draft_reloads_with_the_trained_logits(setup, tmp_path):
    target, cfg, _, data = setup
    head = shared_head(target)
    trained, _ = draft.train(cfg, head, data, draft.DraftOptions(steps=3, batch=4, anchors=8, warmup=1), log=None)
    params = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(trained))}
    export.write_draft(tmp_path, DRAFT_PRESETS["k3-tiny-dspark"], params)
    _, loaded = load_draft(tmp_path, target.config, dtype="float32")

    # The serving path with the loaded draft: context taps of positions < p, then one proposal at p.
    rows, page_size = len(data.tokens), 16
    anchors = (data.starts + 3).astype(np.int32)
    pages_per_row = -(-(int(anchors.max()) + cfg.block_size) // page_size)
    table = 1 + np.arange(rows * pages_per_row, dtype=np.int32).reshape(rows, pages_per_row)
    pages = init_draft_pages(cfg, rows * pages_per_row + 1, page_size, jnp.float32)
    width = int(anchors.max())
    valid = np.arange(width)[None] < anchors[:, None]
    pages = inject_context(loaded, pages, jnp.asarray(data.taps[:, :width]), valid, np.zeros(rows, np.int32), table)
    bonus = data.tokens[np.arange(rows), anchors]
    drafts, served, _ = propose(loaded, pages, jnp.asarray(bonus), jnp.asarray(anchors), table, head,
                                temperature=jnp.zeros(rows), keys=jax.random.split(jax.random.key(0), rows),
                                greedy_only=True)

    # The training forward of the trained draft, its weights rounded to bf16 as the checkpoint stores them.
    rounded = jax.tree.map(lambda x: jnp.asarray(x, ml_dtypes.bfloat16).astype(jnp.float32), nnx.state(trained))
    reference = nnx.merge(nnx.graphdef(trained), rounded)
    base = draft.block_logits(reference, head, jnp.asarray(data.tokens), jnp.asarray(data.taps),
                              jnp.asarray(anchors[:, None]))[:, 0]
    previous = jnp.concatenate([jnp.asarray(bonus)[:, None], drafts[:, :-1]], axis=1)
    expected = draft.markov_logits(reference, base, previous)
    np.testing.assert_allclose(np.asarray(served), np.asarray(expected), atol=2e-4, rtol=1e-4)
    assert (np.asarray(drafts) == np.argmax(np.asarray(expected), -1)).all()
