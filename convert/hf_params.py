"""Parameters in the model's layout, read lazily from a Hugging Face safetensors checkpoint.

`HfParams` turns the published tensors into parameter arrays through `convert.layout`: one call per
decoder layer (`layer(i)`) or for the model-level tensors (`model()`), so a caller holds at most one
layer in host memory. Every problem is a `CheckpointError` naming the tensor, what was expected
and what was found.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from convert import layout
from convert.reader import CheckpointError, SafetensorsReader
from convert.vision_layout import PREFIXES as VISION_PREFIXES
from convert.vision_layout import vision_arrays
from k3jax.config import K3Config
from k3jax.vision.config import vision_config

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_SKIPPED = re.compile(r"(^vision_tower\.|^mm_projector\.|rotary_emb\.)")


class HfParams:
    """`dtype` (optional) casts the float parameters, except those the model keeps in float32."""

    def __init__(self, directory, cfg: K3Config, dtype: str | None = None):
        self.cfg = cfg
        self.reader = SafetensorsReader(directory)
        self.dtype = dtype
        self.used: set[str] = set()
        self.bytes_read = 0
        self._decoder, _ = layout.prefixes(cfg)

    def model(self, shardings=None) -> dict[tuple, np.ndarray]:
        """Model-level parameters (embedding, final norms, LM head) by parameter path (host arrays:
        `shardings` is for sources that can read per device)."""
        return dict(self.model_arrays())

    def model_arrays(self):
        """The model-level parameters one at a time, as (path, array): the converter writes each as it comes."""
        rules = [(r, self._decoder + r.name) for r in layout.model_rules(self.cfg)]
        head = layout.lm_head_rule(self.cfg)
        if head:
            rules.append((head, head.name))
        for rule, name in rules:
            yield rule.path, self._cast(rule, self._read(rule, name))

    def layer(self, index: int, shardings=None) -> dict[tuple, np.ndarray]:
        """Parameters of decoder layer `index`, by path relative to the layer module."""
        attn, mlp = self.cfg.layer_kinds()[index]
        prefix = f"{self._decoder}layers.{index}."
        shardings = shardings or {}
        return {r.path: self._cast(r, self._read(r, prefix + r.name, shardings.get(r.path)))
                for r in layout.layer_rules(self.cfg, attn, mlp)}

    def vision(self) -> dict[tuple, np.ndarray]:
        """The vision tower's parameters by path in the tower (`convert.vision_layout`); {} when the
        config has no tower or the checkpoint no vision tensors (a text-only checkpoint)."""
        vcfg = vision_config(self.cfg)
        stored = {n for n in self.reader.names() if n.startswith(VISION_PREFIXES)}
        if vcfg is None or not stored:
            return {}
        return vision_arrays(vcfg, stored, lambda r: self._cast(r, self._tensor(r, r.name, r.shape)))

    def _cast(self, rule: layout.Rule, array: np.ndarray) -> np.ndarray:
        """`array` in the parameter dtype and C order (a copy only when one of them changes)."""
        return np.asarray(array, self._param_dtype(rule, array.dtype), order="C")

    def _param_dtype(self, rule: layout.Rule, stored: np.dtype) -> np.dtype:
        if self.dtype is None or rule.dtype == layout.U8:
            return stored
        return np.dtype(np.float32 if rule.dtype == layout.F32 else _NUMPY_DTYPES[self.dtype])

    def check_unused(self) -> None:
        """Raises if the checkpoint holds text tensors that no parameter consumed."""
        mtp = re.compile(re.escape(self._decoder) + r"layers\.(\d+)\.")
        unused = []
        for name in self.reader.names():
            if name in self.used or _SKIPPED.search(name):
                continue
            m = mtp.match(name)
            if m and int(m.group(1)) >= self.cfg.num_hidden_layers:  # MTP layers stored after the decoder
                continue
            unused.append(name)
        if unused:
            raise CheckpointError(f"{len(unused)} checkpoint tensors match no parameter of this config, e.g. "
                                  f"{sorted(unused)[:5]}")

    def _read(self, rule: layout.Rule, name: str, sharding=None) -> np.ndarray:
        if rule.transform == "experts":
            names = [name.format(e=e) for e in range(self.cfg.num_experts)]
            stacked = np.empty((len(names), *rule.shape), self._check(rule, names[0], rule.shape))
            local = _local_rows(sharding, stacked.shape)
            for e, expert in enumerate(names):  # read in place: no per-expert arrays to stack
                if e in local:
                    self._tensor(rule, expert, rule.shape, out=stacked[e])
                else:  # another process's expert: checked, never read (its rows stay unwritten)
                    self._check(rule, expert, rule.shape)
                    self.used.add(expert)
            return stacked
        array = self._tensor(rule, self._present(name, rule), None)
        if rule.transform in ("linear", "vector", "squeeze"):
            _expect(name, array, rule.shape)
            return array.reshape(-1) if rule.transform == "squeeze" else array
        if rule.transform == "conv":  # [P, 1, W] or [P, W] -> [W, P]
            p, _, w = rule.shape
            if array.shape not in ((p, 1, w), (p, w)):
                raise CheckpointError(f"{name} has shape {array.shape}, expected {(p, 1, w)} or {(p, w)}")
            return array.reshape(p, w).T
        if rule.transform == "a_log":  # only the first `heads` entries are used (vLLM and SGLang slice too)
            heads = self.cfg.kda_num_heads
            if array.size < heads:
                raise CheckpointError(f"{name} has {array.size} entries, fewer than the {heads} KDA heads")
            return array.reshape(-1)[:heads]
        raise AssertionError(f"unknown transform {rule.transform}")

    def _present(self, name: str, rule: layout.Rule) -> str:
        """`name`, or the alias under which this checkpoint stores the tensor."""
        if name in self.reader:
            return name
        for alias in rule.aliases:
            candidate = name.removesuffix(rule.name) + alias
            if candidate in self.reader:
                return candidate
        return name  # reading it raises the error that names the tensor

    def _check(self, rule: layout.Rule, name: str, shape) -> np.dtype:
        """Checks the stored dtype (and shape when given) against the rule; returns the dtype to read as."""
        dtype, stored_shape = self.reader.info(name)
        if rule.dtype == layout.U8:
            if dtype not in (np.uint8, ml_dtypes.float8_e8m0fnu):  # E8M0 scales may be stored as a float8 type
                raise CheckpointError(f"{name} has dtype {dtype}, expected uint8 (MXFP4 codes or scales)")
            dtype = np.dtype(np.uint8)
        elif dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{name} has dtype {dtype}, expected a float type (bfloat16 or float32)")
        if shape is not None and stored_shape != tuple(shape):
            raise CheckpointError(f"{name} has shape {stored_shape}, expected {tuple(shape)}")
        return dtype

    def _tensor(self, rule: layout.Rule, name: str, shape, out: np.ndarray | None = None) -> np.ndarray:
        dtype = self._check(rule, name, shape)
        array = self.reader.read(name, out).view(dtype)
        self.used.add(name)
        self.bytes_read += array.nbytes
        return array


def _local_rows(sharding, shape) -> set[int] | range:
    """Rows (axis 0) that this process's devices hold under `sharding`; all rows without one. With
    experts spread over every device of a multi-host mesh, each host reads only its own experts."""
    if sharding is None:
        return range(shape[0])
    rows = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(range(*index[0].indices(shape[0])))
    return rows


def _expect(name: str, array: np.ndarray, shape) -> None:
    if array.shape != tuple(shape):
        raise CheckpointError(f"{name} has shape {array.shape}, expected {tuple(shape)}")
