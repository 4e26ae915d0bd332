"""The jitted model steps of the engine, over bucketed shapes compiled once at warm-up.

A step feeds rows of new tokens ([rows, tokens], right-padded) through the model against the
cache pools and returns each row's last-token logits. Row counts and chunk lengths are rounded up
to powers of two (`buckets`), padding rows point at the null slot and page, and the page table
always has the width of `max_model_len`: nothing recompiles in steady state.

On a mesh, rows are split over `data` (so row counts are multiples of its size) and heads over
`model`. DP attention, as vLLM and SGLang run it: the page and slot pools split over `data` too, each
data group holding the pages and slots of its own requests (`CacheLayout.groups`, serve/cache.py), so
the cache a device holds shrinks as the mesh grows. A step's rows are laid out in equal blocks, one
per group (`place`), each row in its request's group's block, and the step's slot and page ids are
made local to the block (`PagedState.groups`): every group reads and writes only its own pools, with
nothing exchanged between groups. The MoE stays expert-parallel over every device. What is not a
step (prefix-cache slot copies, the host tier's copies, a PD handoff) addresses the pools by global id.

Images: a runner with `embed_width` (a model with a vision encoder) gives a prefill step that reaches
image positions an input-embeddings override, values [rows, T, H] and a mask [rows, T]. Such a step
is a program of its own per prefill bucket (both are compiled at warm-up): text-only prefills send
nothing more, where one program for both would send [rows, T, H] zeros with every one (235 MB a
step at K3's width and an 8K-token step). Decode steps never hold an image position.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, make_single_device_sharding

from k3jax.decoder import PagedState, TapSpec, init_pools
from k3jax.layers.common import per_group
from k3jax.layers.kda import KDACache, commit_record
from k3jax.model import K3Model
from k3jax.placement import pool_shardings, put
from serve import multihost
from serve.cache import CacheLayout
from serve.kv_offload import compile_transfers, gather_pages, gather_slots, padded, scatter_pages, scatter_slots
from sharding.mesh import data_size, rows_sharding


def buckets(largest: int, smallest: int = 1) -> tuple[int, ...]:
    """`smallest` times powers of two, up to the first size at or above `largest`."""
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return (*sizes, size)


def bucket(value: int, sizes: tuple[int, ...]) -> int:
    return next(s for s in sizes if s >= value)


def place(groups: list[int], num_groups: int, sizes: tuple[int, ...]) -> tuple[list[int], int]:
    """Where the rows of requests in data `groups` go in a step of `num_groups` groups: (each one's row,
    the row count: the smallest of `sizes` that holds them). Group g's requests take the first rows of
    block g of the num_rows / num_groups equal blocks; with one group, row i is the i-th request's."""
    if num_groups == 1:
        return list(range(len(groups))), bucket(len(groups), sizes)
    counts = [0] * num_groups
    for group in groups:
        counts[group] += 1
    num_rows = bucket(num_groups * max(counts), sizes)
    block, taken, positions = num_rows // num_groups, [0] * num_groups, []
    for group in groups:
        positions.append(group * block + taken[group])
        taken[group] += 1
    return positions, num_rows


def request_order(positions: list[int], num_rows: int) -> np.ndarray:
    """int32 [num_rows]: the row of each request in `place`'s order, then the padding rows: what
    gathers a placed step's outputs back into request order."""
    taken = set(positions)
    return np.asarray([*positions, *(i for i in range(num_rows) if i not in taken)], np.int32)


def placed(values: np.ndarray, positions: list[int] | None) -> np.ndarray:
    """values [num_rows, ...] in request order (padding after) moved to the rows `place` gave."""
    if positions is None:
        return values
    out = np.zeros_like(values)
    out[np.asarray(positions, np.int64)] = values[:len(positions)]
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 9), donate_argnums=3)
def _step(structure, groups, params, pools, tokens, lengths, offsets, slots, page_table, taps, embeds=None):
    """Last-token logits [rows, V], the pools, and the tapped hidden states [rows, T, F] (or None).
    tokens: [rows, T], or [rows] for a decode step (what the sampler returns, so a step the engine
    runs ahead takes the previous step's samples as they are). groups: DP attention's blocks
    (`PagedState.groups`). embeds: None, or the (values, mask) override of `K3Transformer.step`."""
    tokens = tokens.reshape(lengths.shape[0], -1)
    out = structure.merge(params).step(tokens, lengths, PagedState(pools, offsets, slots, page_table, groups),
                                       last_only=True, taps=taps, embeds=embeds)
    return out.logits, out.state.layers, out.taps


@functools.partial(jax.jit, static_argnums=(0, 1, 9), donate_argnums=3)
def _verify(structure, groups, params, pools, tokens, lengths, offsets, slots, page_table, taps, order=()):
    """A speculative window per row: logits of every position [rows, W, V], the pools (MLA rows
    written for the whole window, KDA slots untouched), the taps and the KDA records. order: (), or
    with DP attention's groups (`request_order`'s array,): the logits and taps come back in request
    order, the records stay placed, as `_commit` takes them."""
    tokens = tokens.reshape(lengths.shape[0], -1)  # [rows] when the window is one token (as in `_step`)
    out = structure.merge(params).verify(tokens, lengths, PagedState(pools, offsets, slots, page_table, groups),
                                         taps=taps)
    logits, tapped = out.logits, out.taps
    if order:
        logits, tapped = logits[order[0]], None if tapped is None else tapped[order[0]]
    return logits, out.state.layers, tapped, out.records


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _commit(groups, pools, records, slots, accepted, targets):
    """Folds the first accepted[n] window tokens of each row's slot into slot targets[n] (every KDA
    layer; DP attention's groups as in `_step`, the ids local to the row's block)."""
    return tuple(pool if record is None else per_group(commit_record, groups, pool, record, slots, accepted, targets)
                 for pool, record in zip(pools, records))


def array_specs(tree):
    """Each array of `tree` as a ShapeDtypeStruct with its sharding: what lowering reads, never the
    buffers (which a step running meanwhile may donate)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def output_spec(compiled, index: int):
    """Output `index` of a compiled program as ShapeDtypeStructs with their shardings (None stays None)."""
    return jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                        compiled.out_info[index], compiled.output_shardings[index])


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slot(pools, source, target):
    """Copies one KDA slot (state and conv window, every layer) to another; MLA pages are untouched."""
    return tuple(jax.tree.map(lambda a: a.at[target].set(a[source]), pool) if isinstance(pool, KDACache) else pool
                 for pool in pools)


class Runner:
    """Owns the cache pools; `run` is one step over the given rows."""

    def __init__(self, model: K3Model, layout: CacheLayout, *, max_model_len: int, kv_cache_dtype=None,
                 taps: TapSpec | None = None, embed_width: int | None = None, offload=None):
        """offload: the prefix cache's host tier (serve/kv_offload.py), whose staged copies land before
        a step or a slot copy writes the pools."""
        self.spans_processes = multihost.spans_processes(model.mesh)  # the leader announces every step
        if offload is not None and self.spans_processes:  # its gather and scatter would need every process
            raise ValueError("kv_offload_bytes: not on a mesh that spans several processes")
        self.offload = offload
        self.model = model
        self.layout = layout
        self.taps = taps  # the hidden states a speculator reads: every step then returns them
        self.embed_width = embed_width  # set: prefill steps take an embeddings override (images)
        self.page_table_width = -(-max_model_len // layout.page_size)
        if layout.groups != data_size(model.mesh):
            raise ValueError(f"a cache layout of {layout.groups} groups on a mesh with data={data_size(model.mesh)}: "
                             "the pools split over data, one group each (DP attention)")
        make = functools.partial(init_pools, model.config, num_slots=layout.num_slots, num_pages=layout.num_pages,
                                 page_size=layout.page_size, dtype=model.dtype, kv_cache_dtype=kv_cache_dtype)
        # Committed to their devices, one or the mesh's: an input committed to the device (a handoff pulled by
        # jax.experimental.transfer, serve/disagg) would otherwise commit them, and every step would compile again.
        self.pools = jax.device_put(make(), jax.local_devices()[0]) if model.mesh is None \
            else jax.jit(make, out_shardings=self._pool_shardings(make))()
        # What `compile` lowers against: the pools' shapes and shardings, never their (donated) buffers.
        self._pool_specs = array_specs(self.pools)
        # Where arrays written into the pools (host-tier restores, a PD handoff) go first: whole on each device.
        self._whole = make_single_device_sharding(jax.local_devices()[0]) if model.mesh is None \
            else NamedSharding(model.mesh, PartitionSpec())

    def run(self, rows: list[tuple[list[int], int, int, list[int]]], num_rows: int, num_tokens: int, *,
            positions: list[int] | None = None, device_tokens: jax.Array | None = None,
            embeds: tuple[np.ndarray, np.ndarray] | None = None):
        """rows: (new tokens, tokens already cached, slot, pages) each, padded to num_rows x num_tokens,
        at `positions` (`place`'s; default: in order). Returns (float32 logits [num_rows, vocab] of each
        row's last new token (padding rows: garbage), the tapped hidden states [num_rows, num_tokens, F]
        or None).

        device_tokens: int32 [num_rows] on the device, a decode step's tokens used instead of the rows'
        (whose count still sets each row's length): the engine's run-ahead feeds the previous step's
        samples before they reach the host. One process only (a follower could not see them).

        embeds: float32 values [num_rows, num_tokens, H] and a bool mask [num_rows, num_tokens], the
        embeddings that replace the tokens' where the mask is set (a runner with `embed_width`, steps
        of more than one token; None: no image in the step)."""
        self._transfer()
        arrays = self._arrays(rows, num_rows, num_tokens, positions) + self._override(embeds, num_tokens)
        if device_tokens is not None:
            if self.spans_processes:
                raise ValueError("device_tokens: a step over several processes takes host tokens")
            arrays = (device_tokens, *arrays[1:])
        if self.spans_processes:
            multihost.announce(multihost.RUN, *arrays)
        return self._run(arrays)

    def _run(self, arrays):
        logits, self.pools, taps = self._call(_step, arrays[:5], extra=arrays[5:])
        return self._local(logits), taps

    def _override(self, embeds, num_tokens: int) -> tuple:
        """The step's embeddings override as (values, mask), or () for a step that takes none."""
        if embeds is not None and (self.embed_width is None or num_tokens == 1):
            raise ValueError("embeds: only the prefill steps of a runner with embed_width take them")
        return () if embeds is None else tuple(embeds)

    def compile(self, num_rows: int, num_tokens: int):
        """Compiles the step of [num_rows, num_tokens] without running it. Lowering fills jit's caches,
        so the first real step of that shape only dispatches; it reads the pools' shapes, not their
        buffers, so another thread may run steps meanwhile. Returns what the step's logits and taps
        (None without taps) will be (shape, dtype, sharding), for compiling what takes them."""
        arrays = self._arrays([], num_rows, num_tokens)
        compiled = self._call(_step, arrays, pools=self._pool_specs, compile_only=True)
        if self.embed_width is not None and num_tokens > 1:  # the same step with images
            embeds = (np.zeros((num_rows, num_tokens, self.embed_width), np.float32), np.zeros((num_rows, num_tokens), bool))
            self._call(_step, arrays, extra=embeds, pools=self._pool_specs, compile_only=True)
        return self._logits_spec(compiled), output_spec(compiled, 2)

    def compile_verify(self, num_rows: int, window: int):
        """`compile` for `verify`: what its logits, taps and KDA records will be."""
        compiled = self._call(_verify, self._verify_arrays([], num_rows, window, None), pools=self._pool_specs,
                              compile_only=True)
        return self._logits_spec(compiled), output_spec(compiled, 2), output_spec(compiled, 3)

    def compile_commit(self, records, num_rows: int) -> None:
        """`compile` for `commit` of `records` (as `compile_verify` says they will be) over num_rows rows."""
        slots = multihost.replicated(np.zeros(num_rows, np.int32), self.model.mesh)
        with self._mesh():
            _commit.lower(self.layout.groups, self._pool_specs, records, slots, slots, slots).compile()

    def _logits_spec(self, compiled) -> jax.ShapeDtypeStruct:
        logits = compiled.out_info[0]
        # across processes the sampler takes the leader's own copy (`_local`), on its first device
        sharding = make_single_device_sharding(jax.local_devices()[0]) if self.spans_processes \
            else compiled.output_shardings[0]
        return jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=sharding)

    def verify(self, rows: list[tuple[list[int], int, int, list[int]]], num_rows: int, window: int,
               positions: list[int] | None = None):
        """Like `run` over speculative windows (the last token, then the drafts), without touching the
        KDA slots; rows at `positions` (`place`'s). Returns (logits [num_rows, window, vocab] and taps
        or None, both in request order, and the KDA records for `commit`)."""
        arrays = self._verify_arrays(rows, num_rows, window, positions)
        if self.spans_processes:
            multihost.announce(multihost.VERIFY, *arrays)
        return self._verify(arrays)

    def _verify_arrays(self, rows, num_rows: int, window: int, positions: list[int] | None) -> tuple:
        """The step's arrays, and with DP attention's groups the order that brings its outputs back."""
        arrays = self._arrays(rows, num_rows, window, positions)
        if self.layout.groups == 1:
            return arrays
        return (*arrays, request_order(list(range(len(rows))) if positions is None else positions, num_rows))

    def _verify(self, arrays):
        logits, self.pools, taps, records = self._call(_verify, arrays[:5], extra=arrays[5:])
        return self._local(logits), taps, records

    def commit(self, records, slots: np.ndarray, accepted: np.ndarray, targets: np.ndarray | None = None,
               positions: list[int] | None = None) -> None:
        """After `verify`: each row's KDA slot (or targets[n]) gets the state after its first accepted[n]
        window tokens. The arrays are in request order (num_rows long), the verify's rows at `positions`."""
        targets = slots if targets is None else targets
        layout = self.layout
        arrays = (placed(np.asarray(slots) % layout.slots_per_group, positions),
                  placed(np.asarray(accepted, np.int32), positions),
                  placed(np.asarray(targets) % layout.slots_per_group, positions))
        if self.spans_processes:
            multihost.announce(multihost.COMMIT, *arrays)
        self._commit(records, *arrays)

    def _commit(self, records, slots, accepted, targets) -> None:
        slots, accepted, targets = (multihost.replicated(a, self.model.mesh) for a in (slots, accepted, targets))
        with self._mesh():
            self.pools = _commit(self.layout.groups, self.pools, records, slots, accepted, targets)

    def _arrays(self, rows, num_rows: int, num_tokens: int, positions: list[int] | None = None):
        """The step's arrays; slot and page ids local to their group's block (the same ids with one group)."""
        tokens = np.zeros((num_rows, num_tokens), np.int32)
        lengths = np.zeros(num_rows, np.int32)
        offsets = np.zeros(num_rows, np.int32)
        slots = np.zeros(num_rows, np.int32)
        table = np.zeros((num_rows, self.page_table_width), np.int32)
        for i, (new, cached, slot, pages) in zip(range(len(rows)) if positions is None else positions, rows):
            tokens[i, :len(new)] = new
            lengths[i], offsets[i], slots[i] = len(new), cached, slot
            table[i, :len(pages)] = pages
        if self.layout.groups > 1:  # ids local to their group's block (padding's 0 stays the null entry)
            slots %= self.layout.slots_per_group
            table %= self.layout.pages_per_group
        return (tokens[:, 0] if num_tokens == 1 else tokens), lengths, offsets, slots, table

    def copy_slot(self, source: int, target: int) -> None:
        """Copies a KDA slot: a prefix-cache snapshot into a request's slot, or the other way round."""
        # evicted snapshots out first; restores land at the step, after every copy from a snapshot
        # slot that a restore into a request's slot (evicted and reused this step) would overwrite
        self._transfer(restores=False)
        if self.spans_processes:
            multihost.announce(multihost.COPY_SLOT, np.array([source, target], np.int32))
        self._copy(source, target)

    def _copy(self, source, target) -> None:
        with self._mesh():  # host scalars: valid arguments on a mesh spanning several processes
            self.pools = _copy_slot(self.pools, np.int32(source), np.int32(target))

    def read_state(self, pages: list[int], slot: int):
        """A request's cache, on the device (a prefill server hands it to a decode engine: serve/disagg):
        the rows of `pages` in every MLA layer [P, layers, page_size, width] (P: len(pages) padded to a
        power of two with the null page) and the slot's conv windows and states, every KDA layer [1, layers, ...]:
        the host tier's gathers (compile_transfers), and no other op, which would compile on a first handoff."""
        with self._mesh():
            return gather_pages(self.pools, padded(pages)), *gather_slots(self.pools, padded([slot]))

    def write_state(self, pages: list[int], slot: int, handoff) -> None:
        """Writes a serve.disagg.handoff.Handoff (`read_state`'s arrays) into a request's first pages and its slot."""
        self._transfer(restores=False)  # an evicted page or snapshot this overwrites goes to the host first
        indices = padded(pages[:handoff.num_pages(self.layout.page_size)])
        # on the host (the socket's) or on one device (pulled): placed as compile_transfers' programs take them
        arrays = jax.device_put([handoff.page_rows(len(indices)), handoff.conv, handoff.state], self._whole)
        with self._mesh():
            self.pools = scatter_slots(scatter_pages(self.pools, indices, arrays[0]), padded([slot]), *arrays[1:])

    def compile_transfers(self) -> None:
        """Compiles the pools' gathers and scatters (the host tier's copies, serve/kv_offload.py; a PD
        handoff's read_state and write_state) for every count of pages and slots they may move, without
        running them."""
        with self._mesh():
            compile_transfers(self._pool_specs, self.layout.num_pages, self.layout.num_slots, self._whole)

    def _transfer(self, restores: bool = True) -> None:
        """The host tier's staged copies: evicted pages and snapshots out before their page or slot is
        written again, restored ones in before a step reads them."""
        if self.offload is not None and self.offload.pending:
            with self._mesh():
                self.pools = self.offload.transfer(self.pools, self._whole, restores)

    def follow(self, speculator=None) -> None:
        """A follower process of a multi-host server (serve.multihost): runs every step the leader
        announces, on the same arrays, until the leader stops it. The draft's steps go to `speculator`,
        with the hidden states of the last target step."""
        taps = records = None
        while True:
            op, arrays = multihost.receive()
            if op == multihost.STOP:
                return
            if op == multihost.RUN:
                _, taps = self._run(arrays)
            elif op == multihost.VERIFY:
                _, taps, records = self._verify(arrays)
            elif op == multihost.COMMIT:
                self._commit(records, *arrays)
            elif op == multihost.COPY_SLOT:
                self._copy(*arrays[0])
            elif op in (multihost.OBSERVE, multihost.PROPOSE) and speculator is not None:
                speculator.follow(op, arrays, taps)
            else:
                raise RuntimeError(f"the leader announced a step this process cannot run ({op})")

    def stop_followers(self) -> None:
        """Leader: ends the followers' loops (nothing when the mesh is one process's)."""
        if self.spans_processes:
            multihost.announce(multihost.STOP)

    def _local(self, x):
        """The leader's own copy of a step's output (every process joins in making it)."""
        return multihost.local_copy(x, self.model.mesh) if self.spans_processes else x

    def _mesh(self):
        return jax.set_mesh(self.model.mesh) if self.model.mesh is not None else contextlib.nullcontext()

    def _call(self, fn, arrays, *, extra=(), pools=None, compile_only: bool = False):
        """fn(structure, groups, params, pools, *arrays, taps[, extra]): arrays and extra placed by rows;
        extra, one tuple after taps: `_step`'s embeddings override (values, mask), `_verify`'s (order,)."""
        args = (self.model.structure, self.layout.groups, self.model.param_leaves,
                self.pools if pools is None else pools, *self._put_rows(arrays), self.taps)
        if extra:
            args += (tuple(self._put_rows(extra)),)
        with self._mesh():
            return fn.lower(*args).compile() if compile_only else fn(*args)

    def _put_rows(self, arrays):
        model = self.model
        if model.mesh is None:  # committed like the run-ahead's device tokens, so both take one compiled step
            return jax.device_put(list(arrays), jax.local_devices()[0])  # in one call: 5 apart cost 50% more
        # rows over data (a device array, run-ahead tokens, moves without a trip through the host)
        sharding = rows_sharding(model.mesh)
        return (jax.device_put(a, sharding) if isinstance(a, jax.Array) else put(a, sharding) for a in arrays)

    def _pool_shardings(self, make):
        return pool_shardings(jax.eval_shape(make), self.model.mesh)
