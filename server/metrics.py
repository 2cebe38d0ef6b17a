"""Prometheus metrics under a `deepinfer:` prefix, named after vLLM's `vllm:` metrics.

`ServerMetrics` owns its own `CollectorRegistry` (several apps in one process do not clash).
Protocol routes report each request's life through four calls, keyed by request id::

    metrics.on_request_start(rid)                 # arrival (before admission)
    metrics.on_first_token(rid)                   # first delta with tokens
    metrics.on_tokens(rid, len(delta.token_ids))  # every delta with tokens (first one too)
    metrics.on_finish(rid, num_prompt_tokens, finish_reason)   # once, also on abort/error

Engine gauges (running/waiting requests, KV usage) are read from the engine's snapshot at
scrape time by `render(engine)`, one series per engine rank (a `rank` label; `--ep 1` has
rank "0"); prefix-cache counters add up every rank's totals.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from engine.client import EngineClient, RankSnapshot, ResumeSlotStats

PREFIX = "deepinfer:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges as in vLLM's metrics.
_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_ITL_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15),
    *(0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    scheduled: float | None = None
    num_output_tokens: int = 0


class _CumulativeCounters:
    """Prometheus counters fed from cumulative totals (the engine's snapshots): each `advance`
    adds what a (counter, labels) total grew by since the last call."""

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self._seen: dict[tuple[object, ...], float] = {}

    def advance(self, counter: Counter, total: float, *labels: str) -> None:
        key = (counter, *labels)
        counter.labels(self._model, *labels).inc(max(0, total - self._seen.get(key, 0)))
        self._seen[key] = total


class ServerMetrics:
    """The recorder the protocol routes call; every `on_*` call mutates only metrics state.

    Calls with an unknown request id (never started, or already finished) are ignored, so a
    route may call `on_finish` from a `finally` without tracking whether it already did.
    """

    def __init__(self, model_name: str, clock=time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The server process's CPU seconds and memory (`process_*`, as vLLM and most exporters
        # publish them): load tests divide CPU time by streamed tokens.
        ProcessCollector(registry=self.registry)
        self._clock = clock
        self._requests: dict[str, _Timing] = {}
        self._model = model_name
        self._cumulative = _CumulativeCounters(model_name)
        reg = self.registry
        labels = ("model_name",)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg)

        def rank_gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, (*labels, "rank"), registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.num_requests_running = rank_gauge("num_requests_running", "Requests running.")
        self.num_requests_waiting = rank_gauge("num_requests_waiting", "Requests waiting.")
        self.kv_cache_usage = rank_gauge("kv_cache_usage_perc", "Global-KV blocks in use (0..1).")
        self.engine_process_cpu = rank_gauge(
            "engine_process_cpu_seconds",
            "CPU seconds of an engine rank's own process (absent for an in-process engine).",
        )
        self.num_requests_in_flight = gauge("num_requests_in_flight", "Requests in the server.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            (*labels, "finished_reason"),
            registry=reg,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        # Prefix cache (counters advanced from the engine's totals at scrape time).
        self.prefix_cache = {
            "queries": counter("prefix_cache_queries", "Tokens looked up in the prefix cache."),
            "hits": counter("prefix_cache_hits", "Tokens whose KV came from cached blocks."),
            "replayed": counter("prefix_cache_replayed_tokens", "Cached tokens recomputed."),
            "evicted": counter("prefix_cache_evicted_blocks", "Cached blocks evicted."),
        }
        self.replayed_rows = Counter(
            PREFIX + "prefix_cache_replayed_rows",
            "Cached positions recomputed on prefix hits, by layer stack (encoder, decoder).",
            (*labels, "stack"),
            registry=reg,
        )
        self.decoder_skipped_rows = counter(
            "prefix_cache_decoder_skipped_rows",
            "Rows of replaying prefills that skipped the decoder layers (bounded replay).",
        )
        self.prefix_cache_blocks = gauge("prefix_cache_blocks", "Blocks indexed by the cache.")
        # Resume slots (`engine/kv_cache/resume.py`; counters advanced like the above).
        self.resume_slots = {
            "hits": counter("resume_slot_hits", "Admissions restored from a resume slot."),
            "misses": counter("resume_slot_misses", "Admissions that found no usable slot."),
            "corrupt": counter("resume_slot_corrupt", "Slots dropped for a checksum mismatch."),
            "evicted": counter("resume_slot_evictions", "Slots evicted for room."),
        }
        self.resume_slot_bytes = gauge("resume_slot_bytes", "Host bytes held by resume slots.")
        self.resume_slot_count = gauge("resume_slots", "Resume slots held.")
        self._tiers = _TierMetrics(reg, model_name)
        self._speculative = _SpeculativeMetrics(reg, model_name)
        self._planner = _PlannerMetrics(reg, model_name)
        for metric in (
            self.num_requests_in_flight,
            self.prompt_tokens,
            self.generation_tokens,
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
        ):
            metric.labels(model_name)  # zero-valued series exist before the first request
        # per-token series, looked up once (`labels` per token costs the event loop)
        self._inter_token_latency = self.inter_token_latency.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)

    # ---- per-request events --------------------------------------------------------------------

    def on_request_start(self, request_id: str) -> None:
        """A request arrived (call before admission so refused requests count too)."""
        self._requests[request_id] = _Timing(arrival=self._clock())
        self.num_requests_in_flight.labels(self._model).inc()

    def on_scheduled(self, request_id: str, queue_time_s: float) -> None:
        """The engine reported the request's queue time (arrival → first scheduling), once."""
        timing = self._requests.get(request_id)
        if timing is not None and timing.scheduled is None:
            timing.scheduled = timing.arrival + queue_time_s
            self.request_queue_time.labels(self._model).observe(queue_time_s)

    def on_first_token(self, request_id: str) -> None:
        """The first output token reached the server (idempotent)."""
        timing = self._requests.get(request_id)
        if timing is None or timing.first_token is not None:
            return
        now = self._clock()
        timing.first_token = timing.last_token = now
        self.time_to_first_token.labels(self._model).observe(now - timing.arrival)

    def on_tokens(self, request_id: str, num_tokens: int) -> None:
        """`num_tokens` new output tokens arrived in one delta.

        The gap since the previous delta is spread evenly over its tokens for the inter-token
        latency (a speculative step commits several tokens at once).
        """
        timing = self._requests.get(request_id)
        if timing is None or num_tokens <= 0:
            return
        if timing.first_token is None:
            self.on_first_token(request_id)
        now = self._clock()
        num_gaps = num_tokens if timing.num_output_tokens else num_tokens - 1
        if num_gaps > 0 and timing.last_token is not None:
            gap = (now - timing.last_token) / num_gaps
            for _ in range(num_gaps):
                self._inter_token_latency.observe(gap)
        timing.last_token = now
        timing.num_output_tokens += num_tokens
        self._generation_tokens.inc(num_tokens)

    def on_finish(self, request_id: str, num_prompt_tokens: int, finish_reason: str | None) -> None:
        """The request ended (finished, aborted, refused or failed); forgets it.

        finish_reason: the engine's reason (`stop`, `length`, `abort`) or e.g. `error`,
        `rejected`; None counts as `abort`.
        """
        timing = self._requests.pop(request_id, None)
        if timing is None:
            return
        self.num_requests_in_flight.labels(self._model).dec()
        self.prompt_tokens.labels(self._model).inc(max(num_prompt_tokens, 0))
        self.e2e_request_latency.labels(self._model).observe(self._clock() - timing.arrival)
        self.request_success.labels(self._model, str(finish_reason or "abort")).inc()

    # ---- scrape --------------------------------------------------------------------------------

    def refresh_engine_stats(self, engine: EngineClient) -> None:
        """Copy every rank's queue lengths and KV usage into the gauges."""
        ranks = engine.snapshot().ranks
        for snap in ranks:
            rank = str(snap.rank)
            self.num_requests_running.labels(self._model, rank).set(snap.num_running)
            self.num_requests_waiting.labels(self._model, rank).set(snap.num_waiting)
            self.kv_cache_usage.labels(self._model, rank).set(snap.kv_usage)
            if snap.process_cpu_s is not None:
                self.engine_process_cpu.labels(self._model, rank).set(snap.process_cpu_s)
        caches = [snap.prefix_cache for snap in ranks if snap.prefix_cache is not None]
        if caches:
            totals = {
                "queries": sum(c.num_queried_tokens for c in caches),
                "hits": sum(c.num_hit_tokens for c in caches),
                "replayed": sum(c.num_replayed_tokens for c in caches),
                "evicted": sum(c.num_evicted_blocks for c in caches),
            }
            for name, total in totals.items():
                self._cumulative.advance(self.prefix_cache[name], total)
            self.prefix_cache_blocks.labels(self._model).set(
                sum(c.num_cached_blocks for c in caches)
            )
            rows = {
                k: sum(c.replayed_rows.get(k, 0) for c in caches)
                for k in ("encoder", "decoder", "decoder_skipped")
            }
            for stack in ("encoder", "decoder"):
                self._cumulative.advance(self.replayed_rows, rows[stack], stack)
            self._cumulative.advance(self.decoder_skipped_rows, rows["decoder_skipped"])
            self._tiers.refresh(ranks)
            self._refresh_resume_slots([c.resume_slots for c in caches if c.resume_slots])
        self._speculative.refresh(ranks)
        self._planner.refresh(ranks)

    def _refresh_resume_slots(self, pools: list[ResumeSlotStats]) -> None:
        if not pools:
            return
        totals = {
            "hits": sum(p.num_hits for p in pools),
            "misses": sum(p.num_misses for p in pools),
            "corrupt": sum(p.num_corrupt for p in pools),
            "evicted": sum(p.num_evicted for p in pools),
        }
        for name, total in totals.items():
            self._cumulative.advance(self.resume_slots[name], total)
        self.resume_slot_bytes.labels(self._model).set(sum(p.num_bytes for p in pools))
        self.resume_slot_count.labels(self._model).set(sum(p.num_slots for p in pools))

    def render(self, engine: EngineClient | None) -> bytes:
        """The Prometheus text exposition (engine gauges refreshed first when given)."""
        if engine is not None:
            self.refresh_engine_stats(engine)
        return generate_latest(self.registry)


class _SpeculativeMetrics:
    """Speculative decoding (`dspark.md` §5.1), summed over ranks: counters of request-steps,
    drafts proposed / verified / accepted and per-position verified / accepted drafts; gauges
    with the accept-length histogram (request-steps by a + 1) and the verify-rows histogram
    (steps by rows). Counters advance from the engine's totals at scrape time."""

    _COUNTERS = {
        "num_request_steps": ("spec_verify_steps", "Request-steps that drafted."),
        "num_drafted": ("spec_draft_tokens", "Drafts proposed."),
        "num_verified": ("spec_verified_draft_tokens", "Drafts verified."),
        "num_accepted": ("spec_accepted_tokens", "Drafts accepted (no bonus token)."),
    }

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name
        self._counters = {
            field: Counter(f"deepinfer:{name}", doc, ["model_name"], registry=registry)
            for field, (name, doc) in self._COUNTERS.items()
        }
        self._per_position = {
            kind: Counter(
                f"deepinfer:spec_{kind}_per_pos",
                f"Drafts {kind} at position k (1-based).",
                ["model_name", "pos"],
                registry=registry,
            )
            for kind in ("verified", "accepted")
        }
        self._accept_length = Gauge(
            "deepinfer:spec_accept_length_steps",
            "Request-steps that committed `length` tokens (a + 1).",
            ["model_name", "length"],
            registry=registry,
        )
        self._verify_rows = Gauge(
            "deepinfer:spec_verify_rows_steps",
            "Engine steps whose verify forward had `rows` speculative rows.",
            ["model_name", "rows"],
            registry=registry,
        )
        self._cumulative = _CumulativeCounters(model_name)

    def refresh(self, ranks) -> None:
        snaps = [snap.speculative for snap in ranks if snap.speculative is not None]
        if not snaps:
            return
        for field, counter in self._counters.items():
            self._cumulative.advance(counter, sum(getattr(s, field) for s in snaps))
        for kind, counter in self._per_position.items():
            values = [getattr(s, f"{kind}_per_position") for s in snaps]
            for pos in range(1, max(len(v) for v in values)):
                total = sum(v[pos] for v in values if pos < len(v))
                self._cumulative.advance(counter, total, str(pos))
        for gauge, name in (
            (self._accept_length, "accept_length"),
            (self._verify_rows, "verify_rows_per_step"),
        ):
            values = [getattr(s, name) for s in snaps]
            for k in range(max(len(v) for v in values)):
                total = sum(v[k] for v in values if k < len(v))
                if total:
                    gauge.labels(self._model, str(k)).set(total)


class _PlannerMetrics:
    """The verification planner (`dspark.md` §3, §5.1), summed over ranks: counters of
    decisions by reason, scheduled steps by verify tier, Σ budget B, planned requests and
    role-1 CPU time; gauges with the budget histogram (decisions by B), the fraction of planned
    requests that had no survival history (the prior), and the EMA of measured / predicted step
    time per tier (`fixed` for verify-all steps; weighted by the ranks' step counts)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(
                f"deepinfer:spec_planner_{name}", doc, ["model_name", *labels], registry=registry
            )

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(
                f"deepinfer:spec_planner_{name}", doc, ["model_name", *labels], registry=registry
            )

        self._decisions = counter("decisions", "Planner decisions by reason.", "reason")
        self._tier_steps = counter("tier_steps", "Scheduled steps by verify tier (rows).", "tier")
        self._budget = counter("budget_tokens", "Drafts budgeted (sum of B over decisions).")
        self._rows = counter("rows", "Requests planned (sum over decisions).")
        self._cpu = counter("cpu_us", "Role-1 planning time on the host, microseconds.")
        self._budget_steps = gauge("budget_steps", "Planner decisions with budget B.", "budget")
        self._no_history = gauge(
            "no_history_fraction", "Planned requests without survival history (the prior)."
        )
        self._ratio = gauge(
            "step_time_ratio", "EMA of measured / predicted step time per verify tier.", "tier"
        )
        self._cumulative = _CumulativeCounters(model_name)

    def refresh(self, ranks) -> None:
        snaps = [snap.planner for snap in ranks if snap.planner is not None]
        if not snaps:
            return
        for counter, name in (
            (self._decisions, "steps_by_reason"),
            (self._tier_steps, "steps_by_tier"),
        ):
            totals: dict[str, int] = {}
            for snap in snaps:
                for key, value in getattr(snap, name).items():
                    totals[str(key)] = totals.get(str(key), 0) + value
            for key, total in totals.items():
                self._cumulative.advance(counter, total, key)
        for counter, name in (
            (self._budget, "budget_total"),
            (self._rows, "rows_total"),
            (self._cpu, "cpu_us_total"),
        ):
            self._cumulative.advance(counter, sum(getattr(s, name) for s in snaps))
        budgets: dict[int, int] = {}
        for snap in snaps:
            for b, n in snap.steps_by_budget.items():
                budgets[b] = budgets.get(b, 0) + n
        for b, n in budgets.items():
            self._budget_steps.labels(self._model, str(b)).set(n)
        rows = sum(s.rows_total for s in snaps)
        no_history = sum(s.no_history_rows for s in snaps)
        self._no_history.labels(self._model).set(no_history / rows if rows else 0.0)
        weighted: dict[str, tuple[float, int]] = {}
        for snap in snaps:
            monitor = snap.step_time
            for tier, ratio in monitor.ratios.items():
                total, count = weighted.get(str(tier), (0.0, 0))
                n = monitor.counts[tier]
                weighted[str(tier)] = (total + ratio * n, count + n)
        for tier, (total, count) in weighted.items():
            if count:
                self._ratio.labels(self._model, tier).set(total / count)


class _TierMetrics:
    """Per-tier prefix-cache metrics (`cache.md` §2.7), summed over ranks: hit tokens of every
    tier; for the directory tiers (`local`, `shared`) blocks hit, bytes read / written,
    read seconds (total; / hits = mean latency), corrupt blocks and skipped writes by reason,
    GC evictions / expirations / runs and occupancy; for the host tier (`host`) blocks hit,
    evicted, corrupt (`checksum`) and not stored (`no_free_slot`), occupancy and capacity, and
    the bytes copied in and out (`kv_bytes{src,dst}`). Counters advance from the engine's
    totals at scrape time."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name
        labels = ("model_name", "tier")

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(PREFIX + name, doc, (*labels, *extra), registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        self.hit_tokens = counter("prefix_cache_hit_tokens", "Tokens restored, by tier.")
        self.counters = {
            "hits": counter("kv_tier_hit_blocks", "Blocks read from a host or directory tier."),
            "bytes_read": counter("kv_tier_read_bytes", "Bytes read from a directory tier."),
            "bytes_written": counter("kv_tier_written_bytes", "Bytes written to a dir tier."),
            "read_seconds": counter("kv_tier_read_seconds", "Seconds spent in block reads."),
            "evicted": counter("kv_tier_evicted_blocks", "Blocks evicted for space (LRU, GC)."),
            "expired": counter("kv_tier_expired_blocks", "Blocks found or deleted expired."),
            "gc_runs": counter("kv_tier_gc_runs", "GC passes that held the lease."),
        }
        self.corrupt = counter(
            "kv_corrupt_blocks", "Unusable block files (reads that missed), by reason.", "reason"
        )
        self.dropped = counter("kv_writes_dropped", "Blocks not written, by reason.", "reason")
        self.used_bytes = gauge("kv_cache_bytes", "Bytes held by a tier (dirs: last GC scan).")
        self.num_blocks = gauge("kv_cache_blocks", "Blocks held by a tier (dirs: last GC scan).")
        self.capacity = gauge("kv_cache_capacity_bytes", "Byte budget of the host tier.")
        self.copied = Counter(
            PREFIX + "kv_bytes",
            "Block payload bytes copied between tiers.",
            ("model_name", "src", "dst"),
            registry=registry,
        )
        self._cumulative = _CumulativeCounters(model_name)

    def refresh(self, ranks: Sequence[RankSnapshot]) -> None:
        totals: dict[tuple[object, ...], float] = {}
        gauges: dict[tuple[Gauge, str], float] = {}

        def add(metric: Counter, labels: tuple[str, ...], value: float) -> None:
            key = (metric, *labels)
            totals[key] = totals.get(key, 0) + value

        for snap in ranks:
            cache = snap.prefix_cache
            if cache is None:
                continue
            for tier, total in cache.hit_tokens_by_tier.items():
                add(self.hit_tokens, (tier,), total)
            for stats in cache.dir_tiers:
                tier = stats.tier
                for name, metric in self.counters.items():
                    add(metric, (tier,), getattr(stats, name))
                for reason, total in stats.corrupt.items():
                    add(self.corrupt, (tier, reason), total)
                dropped = {**stats.write_errors, **cache.writes_dropped.get(tier, {})}
                for reason, total in dropped.items():
                    add(self.dropped, (tier, reason), total)
                for gauge, value in (
                    (self.used_bytes, stats.used_bytes),
                    (self.num_blocks, stats.num_blocks),
                ):
                    gauges[gauge, tier] = gauges.get((gauge, tier), 0) + value
            host = cache.host
            if host is not None:
                add(self.counters["hits"], ("host",), host.num_hits)
                add(self.counters["evicted"], ("host",), host.num_evicted)
                add(self.corrupt, ("host", "checksum"), host.num_corrupt)
                add(self.dropped, ("host", "no_free_slot"), host.num_dropped)
                for route, total in host.copied_bytes.items():
                    add(self.copied, tuple(route.split("->")), total)
                for gauge, value in (
                    (self.used_bytes, host.num_bytes),
                    (self.num_blocks, host.num_blocks),
                    (self.capacity, host.capacity_bytes),
                ):
                    gauges[gauge, "host"] = gauges.get((gauge, "host"), 0) + value
        for (metric, *labels), total in totals.items():
            self._cumulative.advance(metric, total, *labels)
        for (gauge, tier), value in gauges.items():
            gauge.labels(self._model, tier).set(value)
