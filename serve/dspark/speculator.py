"""What proposes the drafts the engine verifies: the DSpark draft model, or a scripted proposer.

The engine talks to a speculator through three calls, all over the rows of one step:
- `observe(rows, taps, accepted)`: the target just computed these tokens (prefill chunks, or the
  accepted part of verify windows); a DSpark draft writes their context KV into its pages.
- `propose(requests, num_rows)`: the next drafts of each request, continuing its last token (the bonus) at
  position `request.computed`; returns int32 [N, K] and, for probabilistic drafting, the draft
  logits [num_rows, K, V] the rejection test needs (else None).
- `warmup(num_rows, taps)` runs both on padding rows, `compile(taps, num_rows)` only compiles them
  (serve/warmup.py);
- the sizes the engine budgets for: `num_speculative_tokens`, `taps` (target hidden states to
  return), `page_bytes(page_size)` (extra bytes per MLA page).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.decoder import TapSpec
from k3jax.dspark.loading import load_draft
from k3jax.dspark.model import init_draft_pages, inject_context, propose, shared_head
from k3jax.model import Structure
from serve import multihost
from serve.dspark.rejection import draft_keys
from serve.runner import array_specs
from serve.sampling import SamplingBatch


class ScriptedSpeculator:
    """Drafts from a function of the request (for tests and benchmarks): `continuation(request)` returns
    the tokens it believes follow `request.tokens` (e.g. the target's own greedy output: an oracle
    whose drafts are all accepted; or random tokens: nearly all rejected). Greedy drafting only."""

    taps = None
    probabilistic = False

    def __init__(self, num_speculative_tokens: int, continuation: Callable):
        self.num_speculative_tokens = num_speculative_tokens
        self.continuation = continuation

    def page_bytes(self, page_size: int) -> int:
        return 0

    def bind(self, runner, engine_seed: int) -> None:
        pass

    def warmup(self, num_rows: int, taps) -> None:
        pass

    def compile(self, taps, num_rows: int | None = None) -> None:
        pass

    def observe(self, rows, taps, accepted=None, positions=None) -> None:
        pass

    def propose(self, requests, num_rows: int) -> tuple[np.ndarray, None]:
        k = self.num_speculative_tokens
        drafts = np.zeros((len(requests), k), np.int32)
        for i, request in enumerate(requests):
            guess = list(self.continuation(request))[:k]
            drafts[i, :len(guess)] = guess
        return drafts, None


class DSparkSpeculator:
    """The DSpark draft (k3jax.dspark.model) beside the target: its own MLA pages, addressed by the
    target's page table (a draft row for position t lives in the same page id as the target's), so
    the cache manager allocates, shares (prefix cache) and frees both together."""

    def __init__(self, cfg, draft, target, *, num_speculative_tokens: int | None = None,
                 probabilistic: bool = False, kv_cache_dtype=None):
        k = cfg.block_size if num_speculative_tokens is None else num_speculative_tokens
        if not 1 <= k <= cfg.block_size:
            raise ValueError(f"num_speculative_tokens={k}: the draft proposes at most its block_size "
                             f"({cfg.block_size}) tokens per step")
        cfg.check_target(target.config)
        self.cfg = cfg
        self.num_speculative_tokens = k
        self.probabilistic = probabilistic
        self.taps = TapSpec(tuple(cfg.target_layer_ids), cfg.target_hidden_tap)
        graphdef, params = nnx.split(draft)
        self.structure = Structure(graphdef, params)
        self.param_leaves = self.structure.leaves(params)  # as K3Model's: what the jitted steps take
        self.head = shared_head(target)
        self.mesh = target.mesh
        self.kv_cache_dtype = kv_cache_dtype or target.dtype
        self.draft_logits_shape = (k, target.config.vocab_size)

    @classmethod
    def load(cls, path: str, target, *, num_speculative_tokens=None, probabilistic=False, kv_cache_dtype=None):
        cfg, draft = load_draft(path, target.config, dtype=target.dtype, mesh=target.mesh)
        return cls(cfg, draft, target, num_speculative_tokens=num_speculative_tokens, probabilistic=probabilistic,
                   kv_cache_dtype=kv_cache_dtype)

    def page_bytes(self, page_size: int) -> int:
        return self.cfg.num_hidden_layers * page_size * self.cfg.mla_cache_width * jnp.dtype(self.kv_cache_dtype).itemsize

    def bind(self, runner, engine_seed: int) -> None:
        self.page_table_width = runner.page_table_width
        self.engine_seed = engine_seed
        self.spans_processes = runner.spans_processes  # the leader announces the draft's steps too
        make = functools.partial(init_draft_pages, self.cfg, runner.layout.num_pages, runner.layout.page_size,
                                 self.kv_cache_dtype)
        # Committed to their devices, like the runner's pools: the draft's calls return them committed, and a
        # first call on uncommitted pages would compile apart from every later one.
        self.pages = jax.device_put(make(), jax.local_devices()[0]) if self.mesh is None else jax.jit(
            make, out_shardings=NamedSharding(self.mesh, PartitionSpec()))()
        # Draft logits of zeros (probabilistic drafting, a verify without drafts), committed where propose's
        # land: on the mesh, or across processes on the leader's first device (its own copy, `_propose`).
        self.no_draft_logits = jax.device_put(
            np.zeros((1, *self.draft_logits_shape), np.float32),
            NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None and not self.spans_processes
            else jax.local_devices()[0])
        self._page_specs = array_specs(self.pages)  # what `compile` lowers against

    def observe(self, rows, taps, accepted=None, positions=None) -> None:
        """rows: (request, position of its first token here, tokens) over the first rows of taps
        [N, T, F], or its rows `positions` (serve.runner.place); `accepted` (int32 [N]) further limits
        each row to its accepted tokens. The draft's pages are whole on every device: its steps use the
        pages' global ids, whatever data group the target's rows run in."""
        num_rows = taps.shape[0]
        counts = np.zeros(num_rows, np.int32)
        offsets = np.zeros(num_rows, np.int32)
        index = range(len(rows)) if positions is None else positions
        for i, (_, offset, count) in zip(index, rows):
            counts[i], offsets[i] = count, offset
        if accepted is not None:
            counts = np.minimum(counts, np.asarray(accepted, np.int32))
        arrays = (counts, offsets, self._table([r for r, _, _ in rows], num_rows, index))
        if self.spans_processes:
            multihost.announce(multihost.OBSERVE, *arrays)
        self._observe(taps, *arrays)

    def _observe(self, taps, counts, offsets, table, compile_only: bool = False) -> None:
        counts, offsets, table = (multihost.replicated(a, self.mesh) for a in (counts, offsets, table))
        args = (self.structure, self.param_leaves, self._page_specs if compile_only else self.pages, taps, counts,
                offsets, table)
        with self._mesh():
            if compile_only:
                _inject.lower(*args).compile()
            else:
                self.pages = _inject(*args)

    def propose(self, requests, num_rows: int) -> tuple[np.ndarray, object]:
        arrays = self._propose_arrays(requests, num_rows)
        if self.spans_processes:
            multihost.announce(multihost.PROPOSE, *arrays)
        drafts, draft_logits = self._propose(*arrays)
        return np.asarray(drafts)[:len(requests)], draft_logits

    def _propose_arrays(self, requests, num_rows: int) -> tuple:
        bonus = np.zeros(num_rows, np.int32)
        positions = np.zeros(num_rows, np.int32)
        for i, request in enumerate(requests):
            bonus[i], positions[i] = request.tokens[-1], request.computed
        batch = SamplingBatch.from_params([r.params for r in requests], num_rows,
                                          num_generated=[len(r.output) for r in requests],
                                          request_ids=[r.arrival for r in requests], engine_seed=self.engine_seed,
                                          vocab_size=self.draft_logits_shape[1])
        return bonus, positions, self._table(requests, num_rows), *batch

    def _propose(self, bonus, positions, table, *batch, compile_only: bool = False):
        """(drafts, draft_logits or None), as the leader's own copies."""
        bonus, positions, table, *batch = (multihost.replicated(a, self.mesh)
                                           for a in (bonus, positions, table, *batch))
        args = (self.structure, self.param_leaves, self._page_specs if compile_only else self.pages, bonus, positions,
                table, self.head, SamplingBatch(*batch), not self.probabilistic, self.num_speculative_tokens)
        with self._mesh():
            if compile_only:
                _propose.lower(*args).compile()
                return None
            drafts, draft_logits, self.pages = _propose(*args)
        if self.spans_processes:
            drafts = multihost.local_copy(drafts, self.mesh)
            draft_logits = multihost.local_copy(draft_logits, self.mesh) if self.probabilistic else None
        return drafts, draft_logits if self.probabilistic else None

    def follow(self, op: int, arrays: tuple, taps) -> None:
        """A follower's part in the draft's steps the leader announced (serve.multihost)."""
        if op == multihost.OBSERVE:
            self._observe(taps, *arrays)
        else:
            self._propose(*arrays)

    def warmup(self, num_rows: int, taps) -> None:
        self.observe([], taps)
        self.propose([], num_rows)

    def compile(self, taps, num_rows: int | None = None) -> None:
        """Compiles `observe` of taps like `taps` (a ShapeDtypeStruct) and, given num_rows, `propose`,
        without running them: they read the pages' shapes, not their buffers, so steps may run meanwhile."""
        rows = taps.shape[0]
        self._observe(taps, np.zeros(rows, np.int32), np.zeros(rows, np.int32), self._table([], rows),
                      compile_only=True)
        if num_rows is not None:
            self._propose(*self._propose_arrays([], num_rows), compile_only=True)

    def _table(self, requests, num_rows: int, index=None) -> np.ndarray:
        table = np.zeros((num_rows, self.page_table_width), np.int32)
        for i, request in zip(range(len(requests)) if index is None else index, requests):
            table[i, :len(request.pages)] = request.pages
        return table

    def _mesh(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _inject(structure, params, pages, taps, counts, offsets, page_table):
    valid = jnp.arange(taps.shape[1], dtype=jnp.int32)[None, :] < counts[:, None]
    return inject_context(structure.merge(params), pages, taps, valid, offsets, page_table)


@functools.partial(jax.jit, static_argnums=(0, 8, 9), donate_argnums=2)
def _propose(structure, params, pages, bonus, positions, page_table, head, batch, greedy_only, num_tokens):
    return propose(structure.merge(params), pages, bonus, positions, page_table, head, temperature=batch.temperature,
                   keys=draft_keys(batch), greedy_only=greedy_only, num_tokens=num_tokens)
