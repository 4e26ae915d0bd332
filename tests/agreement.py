"""Agreement between numeric paths, certified by margins: the tests' one helper for "the same tokens".

The same model computed along two numeric paths (another mesh, batch or bucket, prefill chunking, a
prefix-cache resume, speculative verify windows, Pallas kernels against XLA, another CPU instruction
set) adds in other orders. Values then agree to a tolerance set by the dtype; a discrete choice made
from them agrees only where the gap it decides on is wider than what the paths can move it:

- the greedy argmax: the gap between the reference's best logit and the token a path picked;
- the router's top-k: the gap between the k-th and (k+1)-th biased expert score. A flip there swaps a
  whole expert of that token's MoE output, and every later position reads that token, so the logits
  from there on differ by far more than rounding (issue 19: a 1-ulp tie, 5.96e-8, at one prompt
  token moved a logprob five positions later by 0.019 and flipped the greedy token).

So a path is never compared with one reference run but with the reference *under the path's own
router choices*: `Referee` runs the reference (a full causal forward, teacher-forced on the path's
tokens) with every router decision's margin recorded; where the path disagrees beyond the tolerance,
it looks for router near-ties (margin below the tolerance) before the disagreement whose flip explains
it, and re-runs the reference with them flipped (a short depth-first search; flips stay rare: a
few per thousand positions in fp32). An assertion fails only when no such choice of near-ties
explains the path: a difference no rounding can make. Greedy tokens are asserted where the
reference's margin exceeds the tolerance; positions inside the tolerance are counted, not asserted,
and the tokens after them stay checked (teacher forcing). Groups of experts (grouped top-k) are not
flipped: a group near-tie leaves the positions from there on unchecked, and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers import ffn
from serve import sampling

MAX_FLIPS = 4  # router flips one reference run can apply (a static shape: one compile)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far two numeric paths may move values: `logits` relative to the largest |logit| of the
    sequence (a logprob moves by at most twice that), `router` absolutely on a biased router score
    (sigmoid or softmax scores, in (0, 1))."""

    logits: float
    router: float


# fp32 (unit roundoff 2^-24 = 6e-8) through ten random k3-tiny layers and paths whose kernels differ
# (chunked against recurrent KDA, naive against absorbed MLA, other chunkings, batches and meshes)
# reaches 6.3e-5 in a router score and 1.0e-4 of the largest logit (measured: prefill + decode
# against the full forward, 8 x 40 tokens, under the default ISA, AVX2 and SSE4.2; meshes 8x2, 2x8 and
# 4x4 stay below that, ~3e-5 and ~6e-5), ~2^10 times the unit roundoff. 2^-11 = 4.9e-4 leaves 5x.
FP32 = Tolerance(logits=2.0 ** -11, router=2.0 ** -11)
# bf16 (unit roundoff 2^-9) moves everything 2^15 times as far: 2^-11 * 2^15 = 16 is no tolerance at
# all. Router near-ties are everywhere at that scale, so bf16 paths are compared by value (on
# teacher-forced tokens), and greedy identity is checked in fp32.
TOLERANCES = {np.dtype(np.float32): FP32}


def tolerance(dtype) -> Tolerance:
    dtype = np.dtype(dtype)
    if dtype not in TOLERANCES:
        raise ValueError(f"no greedy tolerance for {dtype}: compare {dtype} paths by value, greedy ones in fp32")
    return TOLERANCES[dtype]


# --- the reference forward, with router margins recorded and chosen near-ties flipped ---------------

class _Sink:
    """Where the router callbacks of the run in progress go (XLA calls them from its own threads)."""

    records: list | None = None


_SINK = _Sink()


def _record(margin, top, group_margin, applied):
    if _SINK.records is not None:
        _SINK.records.append((np.asarray(margin), np.asarray(top), np.asarray(group_margin), int(applied)))


def _scores(x, kernel, bias, cfg):
    """ffn.route's scores and biased choice (grouped top-k masks the dropped groups), and the group margin."""
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32).T)  # kernel [E, H]
    scores = jax.nn.sigmoid(logits) if cfg.moe_router_activation_func == "sigmoid" else jax.nn.softmax(logits, -1)
    choice = scores + bias
    group_margin = jnp.full(x.shape[:1], jnp.inf, jnp.float32)
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:
        t = x.shape[0]
        grouped = choice.reshape(t, cfg.num_expert_group, -1)
        group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
        if cfg.topk_group < cfg.num_expert_group:
            best = jax.lax.top_k(group_scores, cfg.topk_group + 1)[0]
            group_margin = best[:, -2] - best[:, -1]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        kept = jnp.zeros_like(group_scores, bool).at[jnp.arange(t)[:, None], keep].set(True)
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, -1)
    return scores, choice, group_margin


def _route_with_margins(route, flips, router_tol):
    """ffn.route, recording each token's top-k margin and, for each flip (token index, a, b) whose
    token has a at rank k and b at rank k + 1 within `router_tol`, choosing b instead of a."""

    def patched(x, kernel, bias, cfg):
        ids, weights = route(x, kernel, bias, cfg)
        k = cfg.num_experts_per_token
        scores, choice, group_margin = _scores(x, kernel, bias, cfg)
        values, top = jax.lax.top_k(choice, k + 1)
        margin = values[:, k - 1] - values[:, k]  # inf - inf (a kept group of exactly k experts): nan
        margin = jnp.where(jnp.isfinite(values[:, k]), margin, jnp.inf)
        token = jnp.arange(x.shape[0])
        hit = jnp.any((flips[:, 0][None, :] == token[:, None]) & (flips[:, 1][None, :] == top[:, k - 1:k])
                      & (flips[:, 2][None, :] == top[:, k:k + 1]), axis=1) & (margin < router_tol)
        swapped = jnp.where(ids == top[:, k - 1:k], top[:, k:k + 1], ids)
        raw = jnp.take_along_axis(scores, swapped, axis=-1)
        if cfg.moe_renormalize:
            raw = raw / jnp.sum(raw, axis=-1, keepdims=True)
        ids = jnp.where(hit[:, None], swapped, ids)
        weights = jnp.where(hit[:, None], raw * cfg.routed_scaling_factor, weights)
        jax.debug.callback(_record, margin, top[:, k - 1:], group_margin, jnp.sum(hit))
        return ids.astype(jnp.int32), weights

    return patched


@contextlib.contextmanager
def _patched_route(flips, router_tol):
    original = ffn.route
    ffn.route = _route_with_margins(original, flips, router_tol)
    try:
        yield
    finally:
        ffn.route = original


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens, flips, router_tol):
    with _patched_route(flips, router_tol):  # traced once per shape; the trace keeps the patched route
        return nnx.merge(graphdef, params).forward(tokens).logits


@dataclasses.dataclass
class Run:
    """One reference run over a row: logits [T, V] f32; per position the smallest router margin
    (over layers), and the near-ties: (position, expert a at rank k, expert b at rank k + 1, margin)."""

    logits: np.ndarray
    router_margin: np.ndarray
    group_margin: np.ndarray
    near_ties: list
    flips: tuple
    applied: int



def flip_table(flips) -> jax.Array:
    """Router flips [(token index, expert a, expert b), ...] as the int32 [MAX_FLIPS, 3] table the
    patched route reads (unused rows -1)."""
    if len(flips) > MAX_FLIPS:
        raise ValueError(f"more than {MAX_FLIPS} router flips")
    table = np.full((MAX_FLIPS, 3), -1, np.int32)
    for i, flip in enumerate(flips):
        table[i] = flip[:3]
    return jnp.asarray(table)


@contextlib.contextmanager
def following(table, router_tol: float = FP32.router):
    """While tracing a forward of the target (a jitted function taking `table` as an argument), its
    routers take the flips in `table`: another path (e.g. a DSpark draft's one-shot context) then
    runs under the router choices a `Certificate` found."""
    with _patched_route(table, router_tol):
        yield


# --- the referee ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Certificate:
    """One row checked: the reference run under the router choices that explain it (`run.flips`),
    positions asserted (`checked`) and positions inside the tolerance (`skipped`: counted only)."""

    run: Run
    checked: int
    skipped: int


@dataclasses.dataclass
class Report:
    """Certificates of several rows, summed."""

    certificates: list = dataclasses.field(default_factory=list)

    @property
    def checked(self) -> int:
        return sum(c.checked for c in self.certificates)

    @property
    def skipped(self) -> int:
        return sum(c.skipped for c in self.certificates)

    @property
    def flips(self) -> int:
        return sum(len(c.run.flips) for c in self.certificates)

    def add(self, certificate: Certificate) -> Certificate:
        self.certificates.append(certificate)
        return certificate

    def __str__(self):
        return (f"{self.checked} positions checked, {self.skipped} inside the tolerance (not asserted), "
                f"{self.flips} router flips followed")


class Referee:
    """Teacher-forced full forwards of `model` (fp32, one device) over rows padded to `pad` tokens
    (one compile), with the router margins of every position, and the checks built on them."""

    SEARCH_RUNS = 64  # reference runs one search may spend before it calls the path unexplained

    def __init__(self, model, pad: int = 128, tol: Tolerance | None = None):
        if model.mesh is not None:
            raise ValueError("the referee runs the one-device model")
        self.model = model
        self.pad = pad
        self.tol = tol or tolerance(model.dtype)

    def run(self, tokens, flips=()) -> Run:
        tokens = [int(t) for t in tokens]
        if len(tokens) > self.pad:
            raise ValueError(f"{len(tokens)} tokens do not fit the referee's {self.pad}")
        padded = np.zeros((1, self.pad), np.int32)
        padded[0, :len(tokens)] = tokens
        _SINK.records = []
        try:
            logits = np.asarray(_forward(self.model.graphdef, self.model.params, jnp.asarray(padded),
                                         flip_table(flips), jnp.float32(self.tol.router)))
            jax.effects_barrier()
            records = _SINK.records
        finally:
            _SINK.records = None
        assert records, "the reference forward never called ffn.route: the referee no longer sees the router"
        n = len(tokens)
        margins = np.stack([m[:n] for m, _, _, _ in records])  # [MoE layers, n]
        tops = np.stack([t[:n] for _, t, _, _ in records])  # [MoE layers, n, 2]: experts at ranks k, k + 1
        groups = np.stack([g[:n] for _, _, g, _ in records])
        ties = [(int(s), int(tops[l, s, 0]), int(tops[l, s, 1]), float(margins[l, s]))
                for l, s in zip(*np.nonzero(margins < self.tol.router))]
        return Run(logits[0, :n], margins.min(0), groups.min(0), sorted(ties), tuple(flips),
                   sum(a for _, _, _, a in records))

    def unchecked_from(self, run: Run) -> int:
        """The first position whose grouped-top-k group choice is within the tolerance (group flips are
        not followed): nothing from there on is asserted. len(run.logits) when there is none."""
        near = np.nonzero(run.group_margin < self.tol.router)[0]
        return int(near[0]) if len(near) else len(run.logits)

    def follow(self, tokens, mismatch, what: str) -> Run:
        """The reference run under router choices that explain a path: `mismatch(run)` is None when
        the path agrees with `run`, else (first position it disagrees at, message). A disagreement can
        only come from a router near-tie at or before it: those are flipped, tightest first, keeping a
        flip only if it moves the first disagreement later, then on to the next disagreement.
        AssertionError when no choice explains the path."""
        first = self.run(tokens)
        budget = [self.SEARCH_RUNS]
        found = self._search(tokens, first, mismatch, (), 0, budget)
        if found is None:
            position, message = mismatch(first)
            ties = [t for t in first.near_ties if t[0] <= position]
            raise AssertionError(f"{what}: {message} at position {position}, and no flip of the {len(ties)} router "
                                 f"near-ties before it (margins below {self.tol.router:.2g}) explains it")
        return found

    def _search(self, tokens, run, mismatch, flips, start, budget):
        found = mismatch(run)
        if found is None:
            return run
        position = found[0]
        if len(flips) == MAX_FLIPS:
            return None
        candidates = [t for t in run.near_ties if start <= t[0] <= position and t[:3] not in flips]
        for tie in sorted(candidates, key=lambda t: t[3]):  # the tightest first
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            flipped = flips + (tie[:3],)
            next_run = self.run(tokens, flipped)
            if next_run.applied < len(flipped):  # one of them is no longer a near-tie under the others
                continue
            later = mismatch(next_run)
            if later is not None and later[0] <= position:  # it does not explain this disagreement
                continue
            result = self._search(tokens, next_run, mismatch, flipped, tie[0], budget)
            if result is not None:
                return result
        return None

    def _tokens_check(self, prompt, output, logprobs, allowed_at, what) -> Certificate:
        """A path's `output` after `prompt`: output[i] must lie in allowed_at(run, i, row) (the tokens
        a path within the tolerance could pick from the reference logits `row`), and each logprob in
        logprobs[i] ({token: logprob}) must be the reference's within twice the logits tolerance."""
        prompt, output = [int(t) for t in prompt], [int(t) for t in output]
        tokens = prompt + output[:-1]
        at = np.arange(len(prompt) - 1, len(tokens))  # the position whose logits chose output[i]
        if logprobs is not None and len(logprobs) != len(output):
            raise ValueError(f"{len(logprobs)} logprobs entries for {len(output)} tokens")

        def mismatch(run):
            scale = np.abs(run.logits).max()
            last = self.unchecked_from(run)
            for i, position in enumerate(at):
                if position >= last:
                    break
                row = run.logits[position].astype(np.float64)
                allowed = allowed_at(run, i, row)
                if output[i] not in allowed:
                    return int(position), (f"output {i} is {output[i]}, where the reference allows "
                                            f"{sorted(allowed)[:4]} (logits {row[output[i]]:.4f} against "
                                            f"{row.max():.4f}; tolerance {self.tol.logits * scale:.2g})")
                if logprobs is not None:
                    logp = row - row.max()
                    logp -= np.log(np.exp(logp).sum())
                    for token, value in logprobs[i].items():
                        if abs(value - logp[token]) > 2 * self.tol.logits * scale:
                            return int(position), (f"output {i}: logprob of {token} is {value:.5f}, "
                                                   f"the reference's {logp[token]:.5f}")
            return None

        run = self.follow(tokens, mismatch, what)
        last = self.unchecked_from(run)
        certain = [position < last and len(allowed_at(run, i, run.logits[position].astype(np.float64))) == 1
                   for i, position in enumerate(at)]
        return Certificate(run, sum(certain), len(certain) - sum(certain))

    def check_greedy(self, prompt, output, logprobs=None, what="output") -> Certificate:
        """`output`: greedy tokens after `prompt` (and optionally their logprobs entries) along some
        path. Each must be the reference's argmax, teacher-forced on the same tokens, unless another
        token is within the tolerance of it (then counted as skipped)."""

        def allowed_at(run, i, row):
            slack = 2 * self.tol.logits * np.abs(run.logits).max()
            return set(np.nonzero(row >= row.max() - slack)[0].tolist())

        return self._tokens_check(prompt, output, logprobs, allowed_at, what)

    def check_sampled(self, prompt, output, params, logprobs=None, what="output") -> Certificate:
        """`output`: tokens the engine's sampler drew after `prompt` for a seeded request with
        `params` (temperature, top_k, top_p, min_p; no penalties, no min_tokens). The draw is a
        Gumbel-max over the filtered logits under the request's key (serve/sampling.py): each token
        must be that draw from the reference logits, unless the tolerance could change the draw (a
        Gumbel-perturbed near-tie, or a token at the edge of top-k / top-p / min-p)."""
        if params.seed is None or params.uses_penalties or params.min_tokens or params.greedy:
            raise ValueError("check_sampled takes seeded sampled requests without penalties or min_tokens")
        temperature = params.temperature

        def allowed_at(run, i, row):
            delta = 2 * self.tol.logits * np.abs(run.logits).max() / temperature  # |change| of a scaled logit, x2
            scaled = row / temperature
            sure, maybe = _kept(scaled, params, delta)
            z = scaled + _gumbel(params, i, len(row))
            best = z[sure].max()
            return set(np.nonzero(maybe & (z >= best - delta))[0].tolist())

        return self._tokens_check(prompt, output, logprobs, allowed_at, what)

    def check_logprobs(self, prompt, output, logprobs, what="output") -> Certificate:
        """`output`: tokens some path chose after `prompt` by a rule not checked here (e.g. speculative
        rejection sampling); their logprobs entries must be the reference's, teacher-forced."""
        return self._tokens_check(prompt, output, logprobs, lambda run, i, row: range(len(row)), what)

    def check_logits(self, tokens, got, positions=None, what="logits", tol: float | None = None) -> Certificate:
        """got [len(positions), V]: a path's logits at `positions` (default all) of `tokens` equal the
        reference's within `tol` (default the dtype's) of the largest |logit|."""
        tokens = [int(t) for t in tokens]
        positions = np.arange(len(tokens)) if positions is None else np.asarray(positions)
        got = np.asarray(got, np.float64)
        tol = self.tol.logits if tol is None else tol

        def mismatch(run):
            want = run.logits[positions]
            scale = np.abs(run.logits).max()
            bad = (np.abs(got - want).max(-1) > tol * scale) & (positions < self.unchecked_from(run))
            if not bad.any():
                return None
            i = int(np.argmax(bad))
            return int(positions[i]), f"logits off by {np.abs(got[i] - want[i]).max():.3g} (tolerance {tol * scale:.3g})"

        run = self.follow(tokens, mismatch, what)
        unchecked = int((positions >= self.unchecked_from(run)).sum())
        return Certificate(run, len(positions) - unchecked, unchecked)

    def check_loglikelihood(self, context, continuation, loglikelihood, is_greedy=None,
                            what="request") -> Certificate:
        """A path's log-likelihood of `continuation` after `context` (the sum of its tokens' logprobs)
        is the reference's within len(continuation) logprob tolerances, and its `is_greedy` (every
        continuation token the argmax) the reference's unless a continuation token is within the
        tolerance of the best (then the verdict is counted as skipped, not asserted)."""
        context, continuation = [int(t) for t in context], [int(t) for t in continuation]
        tokens = context + continuation
        at = np.arange(len(context) - 1, len(tokens) - 1)  # position t - 1 scores token t

        def verdict(run):
            """(the reference's is_greedy, whether every path within the tolerance gives the same)."""
            slack = 2 * self.tol.logits * np.abs(run.logits).max()
            rows = run.logits[at].astype(np.float64)
            chosen = rows[np.arange(len(at)), continuation]
            rivals = np.where(np.arange(rows.shape[1]) == np.asarray(continuation)[:, None], -np.inf, rows).max(-1)
            if np.any(chosen < rivals - slack):  # some token surely not the argmax
                return False, True
            return bool(np.all(chosen > rivals)), bool(np.all(chosen > rivals + slack))

        def mismatch(run):
            if at[-1] >= self.unchecked_from(run):
                return None
            rows = run.logits[at].astype(np.float64)
            logp = rows - rows.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            want = float(logp[np.arange(len(at)), continuation].sum())
            bound = len(at) * 2 * self.tol.logits * np.abs(run.logits).max()
            if abs(loglikelihood - want) > bound:
                return int(at[0]), f"log-likelihood {loglikelihood:.6f}, the reference's {want:.6f} (bound {bound:.2g})"
            greedy, sure = verdict(run)
            if is_greedy is not None and sure and bool(is_greedy) != greedy:
                return int(at[0]), f"is_greedy {is_greedy}, the reference's {greedy}"
            return None

        run = self.follow(tokens, mismatch, what)
        certain = at[-1] < self.unchecked_from(run) and (is_greedy is None or verdict(run)[1])
        return Certificate(run, len(at) if certain else 0, 0 if certain else len(at))

    def stable_prefix(self, prompt, output) -> int:
        """How many leading tokens of `output` (greedy after `prompt`) every path within the tolerance
        produces: up to the first router near-tie, or logit near-tie. For tests that need a path's
        exact tokens (e.g. to pick a stop token) and choose inputs by this."""
        prompt, output = [int(t) for t in prompt], [int(t) for t in output]
        run = self.run(prompt + output[:-1])
        slack = 2 * self.tol.logits * np.abs(run.logits).max()
        first_tie = min([t[0] for t in run.near_ties] + [self.unchecked_from(run)])
        for i, token in enumerate(output):
            position = len(prompt) - 1 + i
            row = np.sort(run.logits[position])
            if position >= first_tie or row[-1] - row[-2] <= slack or token != np.argmax(run.logits[position]):
                return i
        return len(output)

    def check_all(self, prompts, outputs, logprobs=None, what="request", min_checked=0.9) -> Report:
        """check_greedy over requests. At least `min_checked` of the output tokens must be certified
        (asserted): a check that skipped most positions would check nothing."""
        report = Report()
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            report.add(self.check_greedy(prompt, output, None if logprobs is None else logprobs[i],
                                         what=f"{what} {i} ({len(prompt)} prompt tokens)"))
        print(f"agreement: {len(report.certificates)} {what}s: {report}")  # shown with a failure, or -s
        assert report.checked >= min_checked * (report.checked + report.skipped), str(report)
        return report


def _kept(scaled, params, delta):
    """The tokens surely kept and maybe kept by min-p, top-k and top-p (serve/sampling.py's filters)
    when every scaled logit may move by delta / 2: (sure, maybe) bool [V]."""
    vocab = len(scaled)
    ascending = np.sort(scaled)
    floor = scaled.max() + np.log(params.min_p) if params.min_p > 0 else -np.inf
    edges = [floor]
    k = min(params.top_k, vocab) if params.top_k > 0 else vocab
    floor = max(floor, ascending[vocab - k])
    edges.append(ascending[vocab - k])
    if params.top_p < 1:
        kept = np.where(ascending >= floor, ascending, -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        tail = np.cumsum(probs)
        dropped = min(int(np.sum(tail <= 1 - params.top_p)), vocab - 1)
        floor = max(floor, ascending[dropped])
        # a tail mass may move by up to ~delta (relative): within 2 delta of 1 - top_p it may fall on
        # either side, and the floor with it
        for j in np.nonzero(np.abs(tail - (1 - params.top_p)) <= 2 * delta)[0]:
            edges += [ascending[j], ascending[min(j + 1, vocab - 1)]]
        edges.append(ascending[dropped])
    near_edge = np.zeros(vocab, bool)
    for edge in edges:
        near_edge |= np.abs(scaled - edge) <= delta
    kept = scaled >= floor
    return kept & ~near_edge, kept | near_edge


@functools.lru_cache(maxsize=4096)
def _gumbel_row(seed: int, num_generated: int, vocab: int) -> np.ndarray:
    batch = sampling.SamplingBatch.from_params([sampling.SamplingParams(temperature=1.0, seed=seed)], 1,
                                               num_generated=[num_generated], request_ids=[0])
    key_words = np.asarray(jax.random.key_data(sampling.row_keys(batch)[0]))
    return gumbel_noise_reference(key_words, vocab)


def gumbel_noise_reference(key_words: np.ndarray, vocab: int) -> np.ndarray:
    """float64 [vocab]: k3jax.sampling_noise's noise under uint32 key words [2], written in NumPy from
    its description (triple32(triple32(i + k0) ^ k1), top 23 bits, -log(-log(u)))."""
    def triple32(x):
        x = x ^ (x >> np.uint32(17))
        x = x * np.uint32(0xED5AD4BB)
        x = x ^ (x >> np.uint32(11))
        x = x * np.uint32(0xAC4C1B51)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x31848BAB)
        return x ^ (x >> np.uint32(14))

    k0, k1 = (np.uint32(w) for w in key_words)
    with np.errstate(over="ignore"):
        bits = triple32(triple32(np.arange(vocab, dtype=np.uint32) + k0) ^ k1)
    u = ((bits >> np.uint32(9)).astype(np.float64) + 0.5) / 2.0 ** 23
    return -np.log(-np.log(u))


def _gumbel(params, num_generated: int, vocab: int) -> np.ndarray:
    """The Gumbel noise the engine's sampler adds for a seeded request's `num_generated`-th token."""
    return _gumbel_row(params.seed, num_generated, vocab)
