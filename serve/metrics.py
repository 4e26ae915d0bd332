"""The server's Prometheus metrics (vLLM's names, under the `k3jax:` prefix).

Everything here is written by the engine thread (prometheus_client is thread-safe) and read by
`GET /metrics`; the gauges are a snapshot the engine thread refreshes after each step, so a scrape
never touches engine state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets: TTFT spans a cached 1-token prefill to a 100K-token prompt queued behind others.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests_finished = Counter("k3jax:request_success", "Engine requests finished, by reason "
                                         "(stop, length, or abort for a disconnected client)",
                                         ["finished_reason"], registry=registry)
        self.requests_rejected = Counter("k3jax:request_rejected", "Requests refused with 503: the waiting "
                                         "queue was full", registry=registry)
        self.prompt_tokens = Counter("k3jax:prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.generation_tokens = Counter("k3jax:generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram("k3jax:time_to_first_token_seconds", "Arrival to first token",
                                             buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("k3jax:inter_token_latency_seconds", "Time between two tokens "
                                             "of a request", buckets=INTER_TOKEN_BUCKETS, registry=registry)
        self.running = Gauge("k3jax:num_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge("k3jax:num_requests_waiting", "Requests waiting for a slot", registry=registry)
        self.cache_usage = Gauge("k3jax:kv_cache_usage_perc", "Fraction of MLA pages in use (by requests "
                                 "or the prefix cache)", registry=registry)
        self.free_pages = Gauge("k3jax:cache_free_pages", "Free MLA pages", registry=registry)
        self.total_pages = Gauge("k3jax:cache_pages", "MLA pages a request can use", registry=registry)
        self.free_slots = Gauge("k3jax:cache_free_slots", "Free KDA state slots", registry=registry)
        self.total_slots = Gauge("k3jax:cache_slots", "KDA state slots a request or snapshot can use",
                                 registry=registry)
        self.spec_drafts = Counter("k3jax:spec_decode_num_drafts", "Speculative windows verified with drafts",
                                   registry=registry)
        self.spec_draft_tokens = Counter("k3jax:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=registry)
        self.spec_accepted_tokens = Counter("k3jax:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=registry)
        self.spec_accepted_per_position = Counter("k3jax:spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                                  "accepted, by position in the window", ["position"],
                                                  registry=registry)
        self.spec_acceptance_rate = Gauge("k3jax:spec_decode_acceptance_rate", "Accepted over proposed drafts",
                                          registry=registry)
        self.spec_mean_accepted_length = Gauge("k3jax:spec_decode_mean_accepted_length", "Tokens per verified "
                                               "window: accepted drafts plus the target's own", registry=registry)
        self._spec_seen: dict = {}
        self.prefix_cache_hit_rate = Gauge("k3jax:prefix_cache_hit_rate", "Prompt tokens found in the prefix "
                                           "cache over prompt tokens looked up", registry=registry)

    def observe_engine(self, engine) -> None:
        """Refreshes the gauges from the engine (on the engine thread)."""
        layout, allocator = engine.layout, engine.allocator
        usable_pages = layout.num_pages - layout.groups  # each data group's page 0 is the null page padding rows point at
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.free_pages.set(allocator.free_pages)
        self.total_pages.set(usable_pages)
        self.cache_usage.set(1.0 - allocator.free_pages / usable_pages)
        self.free_slots.set(allocator.free_slots)
        self.total_slots.set(layout.num_slots - layout.groups)  # and its slot 0 the null slot
        if engine.prefix_cache is not None:
            self.prefix_cache_hit_rate.set(engine.prefix_cache.hit_rate)
        if engine.speculator is not None:
            self._observe_speculation(engine.stats())

    def _observe_speculation(self, stats: dict) -> None:
        """The engine's counters are totals; Prometheus counters are advanced by what is new."""
        seen = self._spec_seen
        for counter, key in ((self.spec_drafts, "spec_num_drafts"), (self.spec_draft_tokens, "spec_num_draft_tokens"),
                             (self.spec_accepted_tokens, "spec_num_accepted_tokens")):
            counter.inc(stats[key] - seen.get(key, 0))
        for position, total in enumerate(stats["spec_accepted_per_position"]):
            self.spec_accepted_per_position.labels(str(position)).inc(total - seen.get(position, 0))
            seen[position] = total
        seen.update((k, stats[k]) for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"))
        self.spec_acceptance_rate.set(stats["spec_acceptance_rate"])
        self.spec_mean_accepted_length.set(stats["spec_mean_accepted_length"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
