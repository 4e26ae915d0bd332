"""K3Model: the public handle on a loaded decoder (config, parameters, jitted forward functions)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax import sequence_parallel
from k3jax.config import K3Config, fixed_router_bias
from k3jax.decoder import DecodeState, K3Transformer, init_cache
from k3jax.placement import cache_shardings, check_mesh, place_params, put, split_routed_experts
from pallas_kernels import moe as moe_ops
from sharding.mesh import DATA, as_mesh, data_size, rows_sharding

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def resolve_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type


class Structure:
    """A module's GraphDef and the tree of its parameters, as a jit static argument hashed once.

    jit hashes its static arguments on every call, and hashing a GraphDef walks the whole module
    tree (~1 ms for k3-tiny, more for deeper models): a tax on every decode step. Equal structures
    still compare equal, so models of one config share their compiled steps.

    jit also flattens its arguments on every call, and an nnx.State's Variables flatten in Python
    (250 us a call for k3-tiny's 316 arrays, growing with depth) where a list of arrays flattens in
    C++ (10 us). So the hot paths pass the parameters' leaves (`leaves`) and `merge` puts the tree
    back together while tracing; it still takes the nnx.State itself too."""

    __slots__ = ("graphdef", "params_tree", "_hash")

    def __init__(self, graphdef: nnx.GraphDef, params):
        self.graphdef = graphdef
        self.params_tree = jax.tree.structure(params)
        self._hash = hash((graphdef, self.params_tree))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Structure) and self._hash == other._hash
                                 and self.graphdef == other.graphdef and self.params_tree == other.params_tree)

    def leaves(self, params) -> list:
        """The parameters as `merge` takes them fastest."""
        return self.params_tree.flatten_up_to(params)

    def merge(self, params):
        """The module; `params` is the nnx.State or its leaves (`leaves`)."""
        if isinstance(params, list):
            params = self.params_tree.unflatten(params)
        return nnx.merge(self.graphdef, params)


@functools.partial(jax.jit, static_argnums=0)
def _logits(structure, params, tokens, lengths):
    return structure.merge(params).forward(tokens, lengths).logits


@functools.partial(jax.jit, static_argnums=0, static_argnames="num_top")
def _token_logprobs(structure, params, tokens, lengths, *, num_top: int):
    logprobs = jax.nn.log_softmax(_logits(structure, params, tokens, lengths)[:, :-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)  # position t - 1 predicts t
    ranks = jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32) + 1
    top, top_ids = jax.lax.top_k(logprobs, num_top)
    return TokenLogprobs(chosen[..., 0], ranks, top_ids, top)


class TokenLogprobs(NamedTuple):
    """`K3Model.token_logprobs`: entry t - 1 of each [B, T-1] array is about token t."""

    chosen: np.ndarray  # float32 [B, T-1]: the token's log-probability given those before it
    ranks: np.ndarray  # int32 [B, T-1]: 1 + the number of tokens more likely than it (vLLM's rank)
    top_ids: np.ndarray  # int32 [B, T-1, num_top]: the most likely tokens, best first
    top: np.ndarray  # float32 [B, T-1, num_top]: their log-probabilities


@functools.partial(jax.jit, static_argnums=0, donate_argnames="cache")
def _extend(structure, params, tokens, lengths, cache):
    return structure.merge(params).extend(tokens, lengths, cache)


def _first_rows(x, rows: int):
    """x without the padding rows `K3Model._run` added (x itself when there are none)."""
    return x if x.shape[0] == rows else x[:rows]


class K3Model:
    """A K3 / Kimi Linear text decoder: `logits` for full forwards, `prefill` + `decode` for generation.

    The parameters are an nnx.State (`params`) and the module structure a GraphDef (`graphdef`); every
    call is a pure jitted function of both, with the caches passed in and returned (and donated).
    With a `mesh`, parameters and caches carry the shardings of the logical-axis table, batches are
    split over `data`, XLA partitions the rest and the routed experts run expert-parallel.
    """

    def __init__(self, config: K3Config, graphdef, params, mesh: Mesh | None = None, vision=None):
        self.config = config
        self.vision = vision  # k3jax.vision.encoder.VisionEncoder, or None: the model takes no images
        self.graphdef = graphdef
        self.mesh = mesh
        if mesh is not None:
            check_mesh(config, mesh)
            params = place_params(params, mesh)
        elif moe_ops.wants_split_experts():
            params = split_routed_experts(params)
        self.params = params
        # what the jitted functions take: the structure (static) and the parameters as a list (Structure says why)
        self.structure = Structure(graphdef, params)
        self.param_leaves = self.structure.leaves(params)

    @classmethod
    def from_module(cls, module: K3Transformer, mesh: Mesh | None = None) -> "K3Model":
        graphdef, params = nnx.split(module)
        return cls(module.cfg, graphdef, params, mesh)

    @classmethod
    def random(cls, config: K3Config, *, dtype="float32", seed: int = 0, mesh=None) -> "K3Model":
        """Randomly initialised weights (tests, notebooks, benchmarks); `mesh` as in from_pretrained."""
        module = K3Transformer(config, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(seed))
        return cls.from_module(module, as_mesh(mesh))

    def with_fixed_routing(self) -> "K3Model":
        """This model with `fixed_router_bias` in every router: two numeric paths (bf16 against fp32, a
        kernel against XLA, a window against token-by-token decode) then route alike; with the random
        scores' near-ties a rounding flips expert choices and moves every later value by far more."""
        def fix(path, v):
            if path[-2:] == ("gate", "e_score_correction_bias"):
                bias = v.get_value()
                fixed = np.asarray(fixed_router_bias(bias.shape[-1]), bias.dtype)
                return v.replace(put(fixed, bias.sharding) if self.mesh is not None else jnp.asarray(fixed))
            return v
        params = nnx.from_flat_state([(k, fix(k, v)) for k, v in nnx.to_flat_state(self.params)])
        return K3Model(self.config, self.graphdef, params, self.mesh, self.vision)

    @property
    def dtype(self):
        return self.params["embed_tokens"][...].dtype

    def logits(self, input_ids, lengths=None) -> np.ndarray:
        """Full causal forward without a cache: float32 [B, T, vocab]."""
        tokens, lengths = self._tokens(input_ids, lengths)
        logits = self._run(_logits, tokens, lengths)
        if not logits.is_fully_addressable:  # a mesh over several processes: every process gets all
            logits = multihost_utils.process_allgather(logits, tiled=True)
        return np.asarray(_first_rows(logits, tokens.shape[0]))

    def token_logprobs(self, input_ids, lengths=None, *, num_top: int = 1) -> TokenLogprobs:
        """Each token's log-probability and rank given those before it, and the num_top most likely
        tokens at each position, from a full forward reduced on the devices (the [B, T, vocab] logits
        never reach the host)."""
        tokens, lengths = self._tokens(input_ids, lengths)
        out = self._run(functools.partial(_token_logprobs, num_top=num_top), tokens, lengths)
        if not out[0].is_fully_addressable:  # a mesh over several processes: every process gets all
            out = multihost_utils.process_allgather(out, tiled=True)
        return TokenLogprobs(*(np.asarray(_first_rows(a, tokens.shape[0])) for a in out))

    def init_cache(self, batch: int, max_len: int) -> DecodeState:
        """A cache for `batch` sequences (on a mesh, rounded up to a multiple of its data size)."""
        make = functools.partial(init_cache, self.config, self._padded_rows(batch), max_len, self.dtype)
        if self.mesh is None:
            return make()
        return jax.jit(make, out_shardings=cache_shardings(jax.eval_shape(make), self.mesh))()

    def _run(self, step, tokens, lengths, *cache):
        """`step` (`_logits`, or `_extend` with the cache) on rows split over `data`. A batch that
        `data` does not divide gets empty rows (length 0: they change nothing) up to the next
        multiple, as many as a cache made by `prefill` holds; callers keep the first rows of what
        comes back."""
        if self.mesh is None:
            return step(self.structure, self.param_leaves, tokens, lengths, *cache)
        rows = self._padded_rows(tokens.shape[0])
        if rows > tokens.shape[0]:
            tokens = jnp.pad(tokens, ((0, rows - tokens.shape[0]), (0, 0)))
            lengths = jnp.pad(lengths, (0, rows - lengths.shape[0]))
        batch = rows_sharding(self.mesh)
        with jax.set_mesh(self.mesh):
            return step(self.structure, self.param_leaves, put(tokens, batch), put(lengths, batch), *cache)

    def _padded_rows(self, rows: int) -> int:
        data = data_size(self.mesh)
        return -(-rows // data) * data

    def prefill(self, input_ids, lengths=None, *, max_len: int | None = None, cache: DecodeState | None = None):
        """Runs the prompt (right-padded [B, T], `lengths` real tokens each) and returns
        (logits float32 [B, T, vocab], cache). Pass `cache` to continue earlier sequences (chunked prefill)."""
        tokens, lengths = self._tokens(input_ids, lengths)
        if cache is None:
            cache = self.init_cache(tokens.shape[0], max_len or tokens.shape[1])
        logits, cache = self._run(_extend, tokens, lengths, cache)
        return _first_rows(logits, tokens.shape[0]), cache

    def prefill_sequence_parallel(self, input_ids, lengths=None, *, max_len: int | None = None,
                                  last_only: bool = False):
        """`prefill` from an empty cache with each prompt's tokens split over the mesh's `data` axis
        (k3jax/sequence_parallel.py), for prompts too long for one data group's devices: the same
        (logits, cache), to fp32 rounding, and `decode` continues from the cache. A separate entry
        point, since it cannot continue a cache (no `cache=`) and needs a mesh. `last_only`: the
        logits of each prompt's last token only, [B, vocab] (every position's are vocab floats a token:
        at K3's 163840, more than the cache of a long prompt)."""
        if self.mesh is None:
            raise ValueError("prefill_sequence_parallel splits the prompt over a mesh's data axis; this model has no mesh")
        tokens, lengths = self._tokens(input_ids, lengths)
        b, t = tokens.shape
        max_len = max_len or t
        if max_len < t:
            raise ValueError(f"max_len={max_len} is shorter than the {t}-token prompt")
        padded = sequence_parallel.padded_length(t, data_size(self.mesh), self.config.kda_conv_size)
        tokens = jnp.pad(tokens, ((0, 0), (0, padded - t)))
        with jax.set_mesh(self.mesh):
            logits, cache = sequence_parallel.prefill(
                self.structure, self.param_leaves, put(tokens, NamedSharding(self.mesh, PartitionSpec(None, DATA))),
                put(lengths, NamedSharding(self.mesh, PartitionSpec())), mesh=self.mesh,
                rows=self._padded_rows(b), max_len=max_len, last_only=last_only)
        return (logits if last_only else logits[:, :t]), cache

    def decode(self, tokens, cache: DecodeState):
        """One token per sequence: tokens [B] -> (logits float32 [B, vocab], cache)."""
        tokens = jnp.asarray(tokens, jnp.int32).reshape(-1, 1)
        logits, cache = self._run(_extend, tokens, jnp.ones((tokens.shape[0],), jnp.int32), cache)
        return _first_rows(logits, tokens.shape[0])[:, 0], cache

    def _tokens(self, input_ids, lengths):
        tokens = jnp.asarray(input_ids, jnp.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise ValueError(f"input_ids must be [B, T] token ids, got shape {tokens.shape}")
        ids = np.asarray(tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids hold ids outside [0, vocab_size={self.config.vocab_size})")
        if lengths is None:
            lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        if lengths.shape != (tokens.shape[0],):
            raise ValueError(f"lengths must have one entry per sequence ({tokens.shape[0]}), got {lengths.shape}")
        return tokens, lengths
