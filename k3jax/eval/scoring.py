"""Scoring rows on the mesh: one jitted full forward per batch, reduced on the devices to a summed
log-probability and a greedy flag per row, so only [batch] numbers come back to the host.

The batch is a global array split over `data` (`sharding.mesh.rows_sharding`): on several hosts
each process supplies its own rows (`make_array_from_process_local_data`) and reads back only the
results of those rows. Parameters keep the shardings `from_pretrained` gave them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from k3jax.model import K3Model
from sharding.mesh import DATA, data_size, rows_sharding


@functools.partial(jax.jit, static_argnums=0)
def _score(structure, params, tokens, lengths, starts):
    """Per row: sum over scored positions t in [start, length) of log p(tokens[t] | tokens[:t]), and
    whether every scored token is the argmax of its prediction."""
    logits = structure.merge(params).forward(tokens, lengths).logits
    pred = logits[:, :-1]  # position t-1 predicts token t
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(pred, target[..., None], axis=-1)[..., 0]
    logprob = picked - jax.nn.logsumexp(pred, axis=-1)
    pos = jnp.arange(1, tokens.shape[1])[None, :]
    scored = (pos >= starts[:, None]) & (pos < lengths[:, None])
    total = jnp.sum(jnp.where(scored, logprob, 0.0), axis=1)
    greedy = jnp.all(jnp.where(scored, jnp.argmax(pred, axis=-1) == target, True), axis=1)
    return total, greedy


class Scorer:
    """`scorer(tokens, lengths, starts)` on this process's rows -> (loglikelihood f32, is_greedy) of them."""

    def __init__(self, model: K3Model):
        self.model = model
        self.mesh = model.mesh
        self.shapes: set[tuple[int, int]] = set()  # global batch shapes run (one compile each)
        if self.mesh is not None:
            self.sharding = rows_sharding(self.mesh)

    @property
    def data_size(self) -> int:
        return data_size(self.mesh)

    def __call__(self, tokens: np.ndarray, lengths: np.ndarray, starts: np.ndarray):
        model = self.model
        if self.mesh is None:
            self.shapes.add(tokens.shape)
            total, greedy = _score(model.structure, model.param_leaves, tokens, lengths, starts)
            return np.asarray(total), np.asarray(greedy)
        arrays = [jax.make_array_from_process_local_data(self.sharding, a) for a in (tokens, lengths, starts)]
        self.shapes.add(arrays[0].shape)
        with jax.set_mesh(self.mesh):
            total, greedy = _score(model.structure, model.param_leaves, *arrays)
        if jax.process_count() > 1:
            total, greedy = multihost_utils.global_array_to_host_local_array((total, greedy), self.mesh,
                                                                             PartitionSpec(DATA))
        return np.asarray(total), np.asarray(greedy)
