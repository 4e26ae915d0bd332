"""`load_draft`: a DSpark draft checkpoint directory (config.json + safetensors, one file or shards
with an index) -> (DSparkConfig, DSparkDraft), by the tensor names of convert.dspark_layout.

Names may carry vLLM's `model.` prefix. `embed_tokens.*` / `lm_head.*` are ignored (the target's are
shared), and so are the confidence head's tensors when the config does not enable it (training-only,
as vLLM treats them). Any other tensor the draft does not have, a missing one or a wrong shape is an
error naming it.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from convert.dspark_layout import CONFIDENCE_PREFIX, IGNORED_PREFIXES, draft_tensors
from convert.reader import CheckpointError, SafetensorsReader
from k3jax.config import K3Config
from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.model import DSparkDraft
from k3jax.model import resolve_dtype
from k3jax.placement import place_params
from sharding.mesh import as_mesh

PREFIX = "model."


def load_draft(path: str | os.PathLike, target_cfg: K3Config, *, dtype="bfloat16", mesh=None):
    """Reads the draft at `path` for the target described by `target_cfg` (checked: vocabulary, tap
    width, tapped layers). dtype: the weights' dtype ("bfloat16", "float32" or a jnp dtype; the
    confidence head stays float32). mesh: None, a string such as "8x2" or a jax Mesh; parameters are
    placed with the shardings of their logical axes (sharding.axes)."""
    cfg = DSparkConfig.from_pretrained(path)
    cfg.check_target(target_cfg)
    reader = SafetensorsReader(path)
    layout = draft_tensors(cfg)
    stored = _stored_names(reader, layout, cfg)
    missing = sorted(set(layout) - set(stored))
    if missing:
        raise CheckpointError(f"draft checkpoint {os.fspath(path)} has no tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""))

    abstract = nnx.eval_shape(lambda: DSparkDraft(cfg, dtype=resolve_dtype(dtype)))
    graphdef, state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(state))
    values = {}
    for name, tensor in layout.items():
        _, shape = reader.info(stored[name])
        if tuple(shape) != tensor.shape:
            raise CheckpointError(f"draft tensor {stored[name]!r} has shape {tuple(shape)}, expected {tensor.shape}")
        array = reader.read(stored[name])
        target = targets[tensor.path]
        values[tensor.path] = target.replace(np.asarray(array.T if tensor.transpose else array,
                                                        target.get_value().dtype))
    unfilled = [".".join(map(str, p)) for p in targets if p not in values]
    if unfilled:  # the layout table and the module disagree: a bug here, not in the checkpoint
        raise CheckpointError(f"no draft tensor fills parameters {unfilled[:5]}")
    params = nnx.from_flat_state([(p, values[p]) for p in targets])
    if mesh is not None:
        params = place_params(params, as_mesh(mesh))
    else:
        params = _to_device(params)
    return cfg, nnx.merge(graphdef, params)


def _stored_names(reader: SafetensorsReader, layout: dict, cfg: DSparkConfig) -> dict[str, str]:
    """Layout name -> the name in the file; tensors the draft ignores dropped, unknown ones refused."""
    stored, unexpected = {}, []
    for name in reader.names():
        bare = name.removeprefix(PREFIX)
        if bare in layout:
            if bare in stored:
                raise CheckpointError(f"draft tensor {bare!r} appears twice (as {stored[bare]!r} and {name!r})")
            stored[bare] = name
        elif bare.startswith(IGNORED_PREFIXES) or (bare.startswith(CONFIDENCE_PREFIX)
                                                   and not cfg.enable_confidence_head):
            continue
        else:
            unexpected.append(name)
    if unexpected:
        raise CheckpointError(f"draft checkpoint tensor {min(unexpected)!r} is not part of a "
                              f"{cfg.num_hidden_layers}-layer DSpark draft"
                              + (f" (nor are {sorted(unexpected)[1:4]})" if len(unexpected) > 1 else ""))
    return stored


def _to_device(params: nnx.State) -> nnx.State:
    return jax.tree.map(lambda v: v.replace(jax.device_put(v.get_value())), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
