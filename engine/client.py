"""The engine façade: the one interface the server uses (`EngineClient`).

Two implementations, the same contract:

    InProcessEngine       today's `AsyncEngine` in the API process (`--ep 1`, tests)
    MultiProcessEngine    N rank processes in lockstep, EP + attention DP
                          (`engine.distributed.multiprocess`, `--ep N`)

`build_engine_client(engine_config, parallel_config)` picks one. The server reaches the engine
only through this module: requests (`generate`, `abort`), what it is (`info`), how it is doing
(`is_running`, `failure`, `snapshot`) and its lifecycle (`start`, `shutdown`). Nothing the
façade returns holds engine objects: snapshots are plain frozen dataclasses. Offline tools the
server's command line offers (`kv_cache_report`) are here too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.async_engine import AsyncEngine, EngineConfig
from engine.core import EngineCore
from engine.kv_cache.host import HostPoolStats
from engine.kv_cache.resume import ResumeSlotStats
from engine.kv_cache.store.dirstore import DirStoreStats
from engine.kv_cache.store.report import directory_report, format_directory_report
from engine.kv_cache.store.ttl import TTLPolicy
from engine.outputs import Delta
from engine.sampling_params import SamplingParams
from engine.speculative.metrics import SpeculativeMetrics
from engine.speculative.planner import PlannerMetrics

if TYPE_CHECKING:
    from engine.distributed.config import ParallelConfig
    from engine.structured import CompiledConstraint


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to know about the served model.

    max_model_len: the context limit every rank accepts (the smallest over ranks).
    vocab_size: logits width (grammar bitmasks, detokenize range).
    checkpoint_path: the checkpoint folder (tokenizer); None for a model built in memory.
    num_ranks: engine ranks (1 in process).
    """

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    checkpoint_path: str | None
    num_ranks: int = 1


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    """Cumulative prefix-cache totals of one rank (tokens, blocks)."""

    num_queried_tokens: int
    num_hit_tokens: int
    num_replayed_tokens: int
    num_evicted_blocks: int
    num_cached_blocks: int
    hit_tokens_by_tier: Mapping[str, int] = field(default_factory=dict)  # gpu, host, local, …
    dir_tiers: tuple[DirStoreStats, ...] = ()  # the directory tiers' counters
    writes_dropped: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # tier → why
    # Replayed rows by layer stack (`ModelRunner.replay_rows`): cached positions recomputed
    # through the `encoder` and the `decoder` layers, and replaying rows that skipped the
    # decoder (`decoder_skipped`, decoder bounded replay).
    replayed_rows: Mapping[str, int] = field(default_factory=dict)
    host: HostPoolStats | None = None  # the host tier's counters (None: no host tier)
    resume_slots: ResumeSlotStats | None = None  # None: resume slots off


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's queues and KV pools at a moment (plain data).

    kv_usage: fraction of pool blocks referenced by requests, in [0, 1];
    num_kv_tokens: KV tokens held by running requests (the placement's load);
    process_cpu_s: CPU seconds of the rank's own process so far (`time.process_time()`); None
    for an engine inside the API process, whose CPU the server's `process_*` metrics count.
    """

    rank: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_used_blocks: int
    num_slots: int
    num_used_slots: int
    num_kv_tokens: int
    prefix_cache: PrefixCacheSnapshot | None = None
    speculative: SpeculativeMetrics | None = None  # a copy; None with speculation off
    planner: PlannerMetrics | None = None  # the verification planner's counters (a copy)
    process_cpu_s: float | None = None

    @property
    def is_idle(self) -> bool:
        """Nothing queued or running and no block or slot held."""
        return not (self.num_running or self.num_waiting or self.num_used_blocks) and not (
            self.num_used_slots
        )


@dataclass(frozen=True)
class EngineSnapshot:
    ranks: tuple[RankSnapshot, ...]

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.ranks)


class EngineFailedError(RuntimeError):
    """The engine failed (a rank died or raised) and serves no more requests."""


@runtime_checkable
class EngineClient(Protocol):
    """What the server calls. Implementations are driven from one event loop."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def is_running(self) -> bool:
        """Started, healthy and admitting requests (`/health`)."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine failed, or None while it is healthy."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; let in-flight requests finish (drain, bounded by `timeout`) or
        abort them; then stop every engine thread or process."""
        ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        constraint: CompiledConstraint | None = None,
        cache_salt: str | None = None,
        traffic_class: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream the deltas of one user request (see `AsyncEngine.generate`): raises
        `EngineClosedError` when shutting down, `EngineFailedError` after a failure, and
        ValueError for a duplicate id or a constraint that does not fit. Leaving the
        iteration early aborts the request. After a failure every open stream ends with an
        ABORT delta whose `error` says why."""
        ...

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        """Pre-admission validation: `RequestRejectedError` for a request `generate` would
        fail (see `AsyncEngine.check_request`). Reads only configuration."""
        ...

    def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> EngineSnapshot:
        """Every rank's latest load (the multi-process engine's is at most one step old)."""
        ...

    def resume_slot_payload(self, slot_id: int, generation: int) -> bytes | None:
        """The bytes of a resume slot this engine holds, for another server's pull
        (`engine/kv_cache/resume_dir.py`); None if it holds no such slot."""
        ...


def check_constraint(
    info: EngineInfo, constraint: CompiledConstraint, params: SamplingParams
) -> None:
    """Pre-admission validation of a grammar against the model (ValueError when unfit)."""
    if constraint.vocab_size != info.vocab_size:
        raise ValueError(
            f"the grammar's vocabulary ({constraint.vocab_size}) differs from the model's "
            f"({info.vocab_size})"
        )
    if params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with a grammar (it ends at EOS)")


def rank_snapshot(core: EngineCore, rank: int = 0) -> RankSnapshot:
    """The snapshot of `core` (call between its steps, or accept a value one step old)."""
    scheduler = core.scheduler
    kv = scheduler.kv_manager
    stats = kv.stats()
    reuse, cache = scheduler.prefix_reuse, kv.prefix_cache
    prefix = None
    if reuse is not None and cache is not None:
        reuse_stats, cache_stats = reuse.stats(), cache.stats()
        prefix = PrefixCacheSnapshot(
            reuse_stats.num_queried_tokens,
            reuse_stats.num_hit_tokens,
            reuse_stats.num_replayed_tokens,
            cache_stats.num_evicted,
            cache_stats.num_cached_blocks,
            reuse_stats.hit_tokens_by_tier,
            *_dir_tier_stats(reuse),
            asdict(core.runner.replay_rows),
            reuse_stats.host,
            resume_slots=None if reuse.resume is None else reuse.resume.pool.stats(),
        )
    return RankSnapshot(
        rank=rank,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        kv_usage=kv.usage(),
        num_blocks=stats.num_blocks,
        num_used_blocks=stats.num_used_blocks,
        num_slots=stats.num_slots,
        num_used_slots=stats.num_used_slots,
        num_kv_tokens=stats.num_used_blocks * kv.config.block_tokens,
        prefix_cache=prefix,
        speculative=None
        if core.runner.speculative is None
        else core.runner.speculative.metrics.copy(),
        planner=None
        if core.scheduler.speculation is None
        else core.scheduler.speculation.planner.metrics.copy(),
    )


def _dir_tier_stats(reuse) -> tuple[tuple[DirStoreStats, ...], dict[str, dict[str, int]]]:
    if reuse.store is None:
        return (), {}
    tiers = reuse.store.tiers
    return tuple(store.stats() for store in tiers.stores), tiers.writes_dropped()


def engine_info(core: EngineCore, num_ranks: int = 1) -> EngineInfo:
    model = core.runner.model
    path = model.checkpoint_path
    return EngineInfo(
        max_model_len=core.scheduler.config.max_model_len,
        vocab_size=model.config.vocab_size,
        eos_token_id=model.config.eos_token_id,
        checkpoint_path=None if path is None else str(path),
        num_ranks=num_ranks,
    )


class InProcessEngine:
    """`EngineClient` over an `AsyncEngine` in this process (one rank, no EP).

    `async_engine` is public for tests and benchmarks; the server never touches it.
    """

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine
        self._info = engine_info(async_engine.core)

    @classmethod
    def from_config(cls, config: EngineConfig) -> InProcessEngine:
        return cls(AsyncEngine.from_config(config))

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def is_running(self) -> bool:
        return self.async_engine.is_running

    @property
    def failure(self) -> str | None:
        return None  # a failed step fails its requests only; the loop keeps serving

    async def start(self) -> None:
        await self.async_engine.start()

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        await self.async_engine.shutdown(drain=drain, timeout=timeout)

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        constraint: CompiledConstraint | None = None,
        cache_salt: str | None = None,
        traffic_class: str | None = None,
    ) -> AsyncIterator[Delta]:
        return self.async_engine.generate(
            prompt_token_ids,
            params,
            request_id,
            constraint,
            cache_salt=cache_salt,
            traffic_class=traffic_class,
        )

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        self.async_engine.check_request(prompt_token_ids, params, constraint)

    def abort(self, request_id: str) -> None:
        self.async_engine.abort(request_id)

    def resume_slot_payload(self, slot_id: int, generation: int) -> bytes | None:
        return self.async_engine.resume_slot_payload(slot_id, generation)

    def snapshot(self) -> EngineSnapshot:
        # NOTE: read from the event loop while a step may run in the worker thread; the
        # counters are plain ints, so a scrape sees a value at most one step old.
        return EngineSnapshot((rank_snapshot(self.async_engine.core),))


def kv_cache_report(root: str, ttl: str, budget_bytes: int) -> str:
    """What the KV cache directory `root` holds (blocks and bytes by traffic class and age
    against `budget_bytes` per namespace, expired blocks under the `--kv-ttl` policy `ttl`, the
    GC lease), as text. Read-only: safe on a directory servers are using; needs no engine.

    Raises:
        ValueError: `ttl` is not a TTL policy.
        FileNotFoundError, NotADirectoryError: `root` holds no KV cache.
    """
    policy = TTLPolicy.parse(ttl)
    return format_directory_report(root, directory_report(root, policy), budget_bytes, policy)


def as_client(engine: EngineClient | AsyncEngine) -> EngineClient:
    """`engine` itself, or an `InProcessEngine` over a bare `AsyncEngine`."""
    return InProcessEngine(engine) if isinstance(engine, AsyncEngine) else engine


def build_engine_client(
    config: EngineConfig,
    parallel: ParallelConfig | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> EngineClient:
    """The engine of `config`, loaded: in process for one rank, else a `MultiProcessEngine`
    (spawns the ranks, or the one rank of `parallel.engine_process`, and waits until every rank
    has loaded its shard; blocking).

    on_failure: called once, on the event loop, when the engine fails (the server exits).

    Logs the weights per rank (this checkpoint at its EP size, the released model at EP 8);
    raises ValueError when the EP size does not divide the routed experts, and
    `InsufficientMemoryError` when a rank's weights do not fit its device."""
    if parallel is None or (parallel.ep_size == 1 and not parallel.engine_process):
        from engine.distributed.memory import log_weight_plans
        from engine.models.embedded import resolve_model_source

        log_weight_plans(config, resolve_model_source(config.model), ep_size=1)
        return InProcessEngine.from_config(config)
    from engine.distributed.multiprocess import MultiProcessEngine

    return MultiProcessEngine(config, parallel, on_failure)
