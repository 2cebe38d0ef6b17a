"""One engine rank: a process that loads its shard and steps its own `EngineCore` in lockstep.

    run_rank(spec)          the process entry (torch.multiprocessing spawn target)
      connect to the API process (`spec.address`, HMAC `spec.authkey`; retried while node 0
      is not up yet), say `RankHello`, receive what to serve (`RankSetup`)
      join torch.distributed (gloo on CPU, NCCL on CUDA); check the weights fit the device
      (`memory`), load this rank's experts and log the bytes it holds
      build the core as `AsyncEngine.from_model` does, wrap its runner (`LockstepRunner`)
      send `RankReady`; then loop:
          apply the API's messages (add, abort, grammar vocabulary, stop)
          core.step() if this rank has requests, else the idle step
          send `StepResult` (deltas + snapshot) when anything changed

A rank alone (`--ep 1 --engine-process`) joins no group: it loads and builds the engine as the
API process would (`load_engine_model`, `AsyncEngine.from_model`: async scheduling, step
graphs, the start-up warm-up), steps its core with nothing to agree on, and waits for the
API's next message when it has nothing to run.

The rank owns its requests' scheduling, KV and sampling (attention DP); only routed experts
cross ranks. It ignores SIGINT (Ctrl-C reaches the whole process group; the API process
stops the ranks in order) and exits when the API's connection ends. On any failure it sends
`RankFailed` and exits at once with status 1 (`os._exit`: a rank whose peers are gone must not
wait in `destroy_process_group`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING

import torch

from engine.async_engine import AsyncEngine, EngineConfig, capture_graphs, load_engine_model
from engine.client import engine_info, rank_snapshot
from engine.distributed.coordinator import StepCoordinator, gloo_int_gather
from engine.distributed.expert_parallel import ExpertParallel
from engine.distributed.groups import RankConfig, RankGroups, destroy_groups, init_groups
from engine.distributed.lockstep import LockstepRunner
from engine.distributed.memory import (
    check_plan,
    describe_held,
    plan_weights,
)
from engine.distributed.messages import (
    AbortRequests,
    AddRequests,
    RankFailed,
    RankHello,
    RankReady,
    RankSetup,
    SetGrammarVocabulary,
    StepResult,
    Stop,
    WireConstraint,
    WireRequest,
)
from engine.models import DeepseekV41ForCausalLM, load_model
from engine.models.embedded import resolve_model_source
from engine.request import Request

if TYPE_CHECKING:
    from engine.speculative.drafts import DraftFactory

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 300.0  # how long a rank retries reaching the API process (node 0)
# A rank alone with requests but nothing runnable (waiting for KV) checks its messages this
# often instead of spinning.
ALONE_WAIT_S = 0.002


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs (picklable: it crosses the spawn).

    address / authkey: the API process's listener (on node 0) and its HMAC key.
    num_threads: torch CPU threads of this rank.
    num_local_ranks: the ranks of this node (they share its host memory).
    drafts: tests only: the rank's speculative drafts come from `drafts(model, state)` instead
    of the DSpark drafter (a module-level callable or a partial of one, to cross the spawn).

    What to serve (the engine config) comes from the API process (`RankSetup`).
    """

    rank: RankConfig
    address: tuple[str, int]
    authkey: bytes
    num_threads: int
    num_local_ranks: int = 1
    drafts: DraftFactory | None = None


def run_rank(spec: RankSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"INFO:     [rank {spec.rank.rank}] %(message)s")
    torch.set_num_threads(spec.num_threads)
    conn = connect(spec.address, spec.authkey)
    conn.send(RankHello(spec.rank.rank, os.getpid()))
    try:
        setup = conn.recv()
        if not isinstance(setup, RankSetup):
            raise TypeError(f"expected RankSetup first, got {type(setup).__name__}")
        alone = spec.rank.world_size == 1
        rank = (
            RankEngine.build_alone(spec, setup.engine)
            if alone
            else RankEngine.build(spec, setup.engine, init_groups(spec.rank))
        )
        conn.send(RankReady(spec.rank.rank, rank.info, rank.core.scheduler.limits, rank.snapshot()))
        rank.serve(conn)
    except BaseException:  # noqa: BLE001 (reported to the API process, then exit)
        logger.exception("rank %d failed", spec.rank.rank)
        try:
            conn.send(RankFailed(spec.rank.rank, traceback.format_exc()))
            conn.close()
        except OSError:
            pass
        os._exit(1)
    conn.close()
    destroy_groups()


def connect(address: tuple[str, int], authkey: bytes) -> Connection:
    """The connection to the API process, retried while it is not listening yet (another
    node's API may start after this node's ranks), for up to `CONNECT_TIMEOUT_S`."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def load_rank_model(
    config: EngineConfig, ep: ExpertParallel, num_local_ranks: int
) -> DeepseekV41ForCausalLM:
    """This rank's model: dense parts, attention and DSpark whole, its routed experts only
    (the same choices as the in-process engine's `_load`).

    Raises `InsufficientMemoryError` before reading any tensor when the weights do not fit
    the device (CPU ranks: this node's ranks together in the host's memory).
    """
    path = resolve_model_source(config.model)
    device = torch.device(config.device)
    plan = plan_weights(config, path, ep.size)
    check_plan(plan, device, num_local_ranks)
    model = load_model(
        path,
        device=config.device,
        dtype=getattr(torch, config.dtype),
        quantized_experts=config.quantized_experts,
        expert_parallel=ep,
        engram_placement=plan.engram_placement,
        numerics=config.numerics,
    )
    logger.info("holds its weights: %s", describe_held(model))
    capture_graphs(model, config)
    return model


class RankEngine:
    """The core of one rank and the loop that feeds it (see the module docstring)."""

    def __init__(
        self, rank: int, engine: AsyncEngine, runner: LockstepRunner | None, num_ranks: int
    ):
        """runner: the lockstep wrapper of the core's runner; None for a rank alone."""
        self.rank = rank
        self.core = engine.core
        self.eos_token_id = engine.eos_token_id
        self.runner = runner
        self.info = engine_info(self.core, num_ranks)
        self.stop_requested = False  # a rank alone: told to stop (or the API is gone)
        self._tokenizer_info = None  # xgrammar.TokenizerInfo, from SetGrammarVocabulary

    @classmethod
    def build_alone(cls, spec: RankSpec, engine: EngineConfig) -> RankEngine:
        """The only rank (`ParallelConfig.engine_process`): the in-process engine's model and
        core on this rank's device, no groups and no lockstep."""
        if spec.rank.device_type == "cuda":
            torch.cuda.set_device(spec.rank.device)
        config = dataclasses.replace(engine, device=str(spec.rank.device))
        built = AsyncEngine.from_model(load_engine_model(config), config, draft_factory=spec.drafts)
        return cls(0, built, None, 1)

    @classmethod
    def build(cls, spec: RankSpec, engine: EngineConfig, groups: RankGroups) -> RankEngine:
        """The rank of `engine` (node 0's config) on this rank's device."""
        device_type = torch.device(engine.device).type
        if device_type != spec.rank.device_type:
            raise ValueError(
                f"node 0 serves on {device_type} but this rank was started for "
                f"{spec.rank.device_type} (--device on this node)"
            )
        # NOTE: ranks step synchronously: `LockstepRunner` agrees on each step in `execute`
        # (async scheduling's launch/sample/collect phases are not lockstepped yet).
        config = dataclasses.replace(engine, device=str(spec.rank.device), async_scheduling=False)
        model = load_rank_model(config, ExpertParallel.from_groups(groups), spec.num_local_ranks)
        # NOTE: AsyncEngine is only the builder here (scheduler, KV, runner, step budget as in
        # process); its loop never runs: `serve` drives the core.
        engine = AsyncEngine.from_model(
            model, config, draft_factory=spec.drafts, num_local_ranks=spec.num_local_ranks
        )
        runner = LockstepRunner(engine.core.runner, StepCoordinator(gloo_int_gather(groups.cpu)))
        engine.core.runner = runner
        return cls(groups.rank, engine, runner, groups.world_size)

    def snapshot(self):
        snapshot = rank_snapshot(self.core, self.rank)
        return dataclasses.replace(snapshot, process_cpu_s=time.process_time())

    def serve(self, conn: Connection) -> None:
        if self.runner is None:
            return self._serve_alone(conn)
        while not self.runner.stopped:
            received = self._receive(conn)
            deltas = self.core.step() if self.core.has_work() else None
            if deltas is None:
                self.runner.idle_step()
            if self.runner.fatal is not None:
                raise RuntimeError("a lockstep collective failed") from self.runner.fatal
            if deltas or received:
                conn.send(StepResult(self.rank, tuple(deltas or ()), self.snapshot()))

    def _serve_alone(self, conn: Connection) -> None:
        """Step while there is work; otherwise block until the API's next message. Stops when
        told to, once nothing is in flight (the API drains or aborts its requests first)."""
        while not (self.stop_requested and not self.core.has_work()):
            received = self._receive(conn)
            deltas = self.core.step() if self.core.has_work() else None
            if deltas or received:
                conn.send(StepResult(self.rank, tuple(deltas or ()), self.snapshot()))
            if deltas is None and not self.stop_requested:
                conn.poll(None)  # idle: wait for work
            elif not deltas and self.core.scheduler.num_running == 0:
                conn.poll(ALONE_WAIT_S)  # only requests waiting for KV: do not spin

    def _receive(self, conn: Connection) -> bool:
        """Apply every message waiting on `conn`; True when there was one. The API's end
        closing counts as `Stop`."""
        received = False
        try:
            while conn.poll(0):
                self._apply(conn.recv())
                received = True
        except (EOFError, OSError):
            self._request_stop()
        return received

    def _request_stop(self) -> None:
        if self.runner is None:
            self.stop_requested = True
        else:
            self.runner.stop_requested = True

    def _apply(self, message) -> None:
        if isinstance(message, AddRequests):
            now = time.monotonic()
            for wire in message.requests:
                self.core.add_request(self._request(wire, now))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.core.abort(request_id)
        elif isinstance(message, SetGrammarVocabulary):
            import xgrammar as xgr

            self._tokenizer_info = xgr.TokenizerInfo.deserialize_json(message.tokenizer_info_json)
        elif isinstance(message, Stop):
            self._request_stop()
        else:
            raise TypeError(f"unknown message {type(message).__name__}")

    def _request(self, wire: WireRequest, now: float) -> Request:
        return Request(
            request_id=wire.request_id,
            prompt_token_ids=list(wire.prompt_token_ids),
            params=wire.params,
            seed=wire.seed,
            arrival_time=now,
            eos_token_id=self.eos_token_id,
            index=wire.index,
            constraint=self._constraint(wire.constraint),
            cache_salt=wire.cache_salt,
            traffic_class=wire.traffic_class,
        )

    def _constraint(self, wire: WireConstraint | None):
        if wire is None:
            return None
        import xgrammar as xgr

        from engine.structured import CompiledConstraint

        if self._tokenizer_info is None:
            raise RuntimeError("a constrained request arrived before the grammar vocabulary")
        grammar = xgr.CompiledGrammar.deserialize_json(wire.grammar_json, self._tokenizer_info)
        return CompiledConstraint(wire.spec, grammar, wire.guard)
