"""`MultiProcessEngine`: the `EngineClient` over N rank processes (`--ep N`).

    API process (this object, on the event loop)          rank processes (`rank.run_rank`)
      generate → DPPlacer picks a rank ── AddRequests ──▶   own scheduler, KV, sampler
      abort ──────────────────────────── AbortRequests ─▶   lockstep steps (EP all-to-all)
      streams ◀── deltas ─────────────── StepResult ◀───   after every step
      failure ◀── RankFailed / EOF ◀─────────────────────   a rank raised or died

Transport: one `multiprocessing.connection` per rank over TCP (HMAC-authenticated with a
per-server key), the rank connecting to the API process's listener and getting what to serve in
reply to its hello (`RankSetup`: the engine config). The same code serves ranks on this machine
and on other nodes (`serve_ranks` starts those; they need nothing but the parallel options).
Messages are pickled frozen dataclasses (`messages`), no tensors; a connection that ends tells
at once that its rank died. One reader and one writer thread per
rank keep the event loop from ever blocking on a socket.

Placement (`scaleout.md` §4.1, §6.2): every choice of a user request goes to the rank
`DPPlacer` picks from the ranks' latest snapshots (pushed with every step), with the request's
`affinity_key` (Responses `prompt_cache_key`).

Failure: a rank that raises sends `RankFailed`; one that dies closes its connection. Either
way the peers leave their collectives (gloo/NCCL see the dead peer, at worst after
`ParallelConfig.timeout_s`) and exit; this engine marks itself failed (`is_running` false, so
`/health` is 503), ends every open stream with an ABORT delta that says why, refuses new
requests (`EngineFailedError`) and calls `on_failure` — the server then exits with status 1
(no in-place restart: the ranks' KV and requests are gone anyway; a supervisor restarts the
server). `shutdown` stops every rank in lockstep (`Stop`) and kills any that has not exited
within the timeout, so no rank outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from engine import envs
from engine.async_engine import EngineClosedError, EngineConfig, RequestRejectedError
from engine.choices import fan_out, stream_choices
from engine.client import (
    EngineFailedError,
    EngineInfo,
    EngineSnapshot,
    RankSnapshot,
    check_constraint,
)
from engine.distributed.config import ParallelConfig
from engine.distributed.groups import RankConfig, free_port
from engine.distributed.memory import log_weight_plans
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
from engine.distributed.placement import DPPlacer, PlacementRequest, RankLoad
from engine.distributed.rank import RankSpec, run_rank
from engine.limits import RequestLimits
from engine.models.embedded import resolve_model_source
from engine.outputs import Delta
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.speculative.drafts import DraftFactory
    from engine.structured import CompiledConstraint

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 300.0  # every rank must have connected by then (imports, CUDA init)
ABORT_GRACE_S = 5.0  # on shutdown, aborted requests get this long to report their end
BLOCK_TOKENS = 128


@dataclass
class _Track:
    """One open engine request: where it runs and what its failure delta must say."""

    rank: int
    index: int
    num_prompt_tokens: int
    queue: asyncio.Queue[Delta]
    num_output_tokens: int = 0


class MultiProcessEngine:
    """See the module docstring. Construction spawns the ranks and blocks until every rank
    has loaded its shard (or raises `EngineFailedError`, leaving no process behind)."""

    def __init__(
        self,
        config: EngineConfig,
        parallel: ParallelConfig,
        on_failure: Callable[[str], None] | None = None,
        *,
        drafts: DraftFactory | None = None,
    ) -> None:
        """drafts: tests only: every rank drafts with `drafts(model, state)` (`RankSpec`)."""
        if parallel.node_rank != 0:
            raise ValueError("the API server runs on node 0; other nodes run `serve_ranks`")
        self.parallel = parallel
        self._on_failure = on_failure
        self._drafts = drafts
        # NOTE: a preset is generated here once, before the ranks start; every rank resolves
        # `config.model` again on its own node (another node has its own cache folder).
        path = resolve_model_source(config.model)
        log_weight_plans(config, path, parallel.ep_size)  # ValueError: N does not divide
        self._config = config
        self._tracks: dict[str, _Track] = {}
        self._groups: dict[str, list[str]] = {}
        self._placer = DPPlacer(parallel.ep_size)
        self._snapshots: list[RankSnapshot] = []
        self._accepting = False
        self._failure: str | None = None
        self._stopping = False
        self._vocabulary_sent = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self._outboxes = [queue.SimpleQueue() for _ in range(parallel.ep_size)]
        self._procs: list[mp.Process] = []
        self._conns: dict[int, Connection] = {}
        try:
            self._info = self._launch()
        except BaseException:
            self._kill_local()
            raise

    # ---- launch ---------------------------------------------------------------------------

    def _launch(self) -> EngineInfo:
        parallel = self.parallel
        authkey = secrets.token_bytes(32) if parallel.nnodes == 1 else _shared_authkey()
        bind = parallel.master_addr if parallel.nnodes == 1 else "0.0.0.0"
        single = parallel.nnodes == 1 and parallel.master_port is None
        listener = Listener((bind, 0 if single else parallel.engine_port), authkey=authkey)
        try:
            master_port = free_port() if single else parallel.master_port
            address = (parallel.master_addr, listener.address[1])
            self._procs = spawn_ranks(
                self._config.device, parallel, master_port, address, authkey, drafts=self._drafts
            )
            self._conns, pids = self._accept(listener)
        finally:
            listener.close()
        logger.info("engine ranks connected: pids %s", [pids[r] for r in sorted(pids)])
        ready = self._wait_ready()
        self._snapshots = [ready[r].snapshot for r in range(parallel.ep_size)]
        self._placer.update([_load(s) for s in self._snapshots])
        self._limits = RequestLimits.strictest(ready[r].limits for r in range(parallel.ep_size))
        infos = [ready[r].info for r in range(parallel.ep_size)]
        return dataclasses.replace(
            infos[0],
            max_model_len=min(i.max_model_len for i in infos),
            num_ranks=parallel.ep_size,
        )

    def _accept(self, listener: Listener) -> tuple[dict[int, Connection], dict[int, int]]:
        """Each rank's connection, keyed by the rank its `RankHello` names."""
        accepted: queue.SimpleQueue = queue.SimpleQueue()
        num_ranks = self.parallel.ep_size

        def accept() -> None:
            for _ in range(num_ranks):
                try:
                    accepted.put(listener.accept())
                except OSError as exc:  # the listener closed, or a client failed to log in
                    accepted.put(exc)
                    return

        threading.Thread(target=accept, name="engine-accept", daemon=True).start()
        conns: dict[int, Connection] = {}
        pids: dict[int, int] = {}
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while len(conns) < num_ranks:
            self._check_local_alive("before connecting")
            if time.monotonic() > deadline:
                raise EngineFailedError(
                    f"only ranks {sorted(conns)} of {num_ranks} connected within "
                    f"{CONNECT_TIMEOUT_S:.0f} s"
                )
            try:
                item = accepted.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise EngineFailedError(f"a rank could not connect: {item}")
            if not item.poll(30):
                raise EngineFailedError("a rank connected but did not say which it is")
            hello = item.recv()
            if not isinstance(hello, RankHello) or hello.rank in conns:
                raise EngineFailedError(f"unexpected first message from a rank: {hello!r}")
            item.send(RankSetup(self._config))
            conns[hello.rank], pids[hello.rank] = item, hello.pid
        return conns, pids

    def _wait_ready(self) -> dict[int, RankReady]:
        """Every rank's `RankReady` (loading can take minutes: no deadline while alive)."""
        ready: dict[int, RankReady] = {}
        by_conn = {id(conn): rank for rank, conn in self._conns.items()}
        while len(ready) < len(self._conns):
            self._check_local_alive("while loading")
            waiting = [c for r, c in self._conns.items() if r not in ready]
            for conn in wait(waiting, timeout=0.5):
                rank = by_conn[id(conn)]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise EngineFailedError(f"engine rank {rank} exited while loading") from None
                if isinstance(message, RankFailed):
                    raise EngineFailedError(
                        f"engine rank {rank} failed while loading:\n{message.error}"
                    )
                ready[rank] = message
        return ready

    def _check_local_alive(self, when: str) -> None:
        dead = [(i, p.exitcode) for i, p in enumerate(self._procs) if p.exitcode is not None]
        if dead:
            ranks = self.parallel.local_ranks
            named = ", ".join(f"rank {ranks[i]} (exit code {code})" for i, code in dead)
            raise EngineFailedError(f"engine ranks exited {when}: {named}")

    # ---- EngineClient ---------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def is_running(self) -> bool:
        return self._accepting and self._failure is None

    @property
    def failure(self) -> str | None:
        return self._failure

    def resume_slot_payload(self, slot_id: int, generation: int) -> bytes | None:
        return None  # the ranks' slots stay in their processes (no cross-process pulls yet)

    @property
    def rank_pids(self) -> list[int]:
        """The process ids of this node's ranks (tests, logs)."""
        return [p.pid for p in self._procs if p.pid is not None]

    async def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        for rank, conn in self._conns.items():
            threading.Thread(
                target=self._read, args=(rank, conn), name=f"rank{rank}-read", daemon=True
            ).start()
            threading.Thread(
                target=self._write, args=(rank, conn), name=f"rank{rank}-write", daemon=True
            ).start()
        self._accepting = True

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """See `EngineClient.shutdown`; a second call (the drain's stop, then the lifespan's
        end) is a no-op."""
        if self._stopping:
            return
        self._accepting = False
        if drain and self._tracks and self._failure is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)
        if self._tracks and self._failure is None:
            for request_id in list(self._tracks):
                self._send_abort(request_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), ABORT_GRACE_S)
        self._end_all("the server is shutting down")
        self._stopping = True
        for outbox in self._outboxes:
            outbox.put(Stop())
        await asyncio.to_thread(self._join_local, self.parallel.timeout_s)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        constraint: CompiledConstraint | None = None,
        cache_salt: str | None = None,
        traffic_class: str | None = None,
    ) -> AsyncIterator[Delta]:
        if self._failure is not None:
            raise EngineFailedError(f"the engine failed: {self._failure}")
        if not self._accepting:
            raise EngineClosedError("the engine is shutting down")
        wire = None
        if constraint is not None:
            check_constraint(self._info, constraint, params)
            wire = self._wire(constraint)
        choices = fan_out(request_id, params)
        ids = [choice.request_id for choice in choices]
        if request_id in self._groups or any(rid in self._tracks for rid in ids):
            raise ValueError(f"request id {request_id!r} is already running")
        rank = self._placer.place(PlacementRequest(len(prompt_token_ids), params.affinity_key))
        stream: asyncio.Queue[Delta] = asyncio.Queue()
        requests = []
        for choice in choices:
            requests.append(
                WireRequest(
                    choice.request_id,
                    list(prompt_token_ids),
                    params,
                    choice.seed,
                    choice.index,
                    wire,
                    cache_salt,
                    traffic_class,
                )
            )
            self._tracks[choice.request_id] = _Track(
                rank, choice.index, len(prompt_token_ids), stream
            )
        self._groups[request_id] = ids
        self._idle.clear()
        self._outboxes[rank].put(AddRequests(tuple(requests)))

        def release() -> None:
            self._groups.pop(request_id, None)
            for rid in ids:  # late deltas of aborted choices are dropped by `_dispatch`
                self._tracks.pop(rid, None)
            if not self._tracks:
                self._idle.set()

        choice_stream = stream_choices(choices, stream, self._send_abort, release)
        async with contextlib.aclosing(choice_stream):
            async for delta in choice_stream:
                yield delta

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        """`AsyncEngine.check_request` against the strictest of the limits the ranks reported
        at start (context length, KV pool, activation budget): the same rules and messages."""
        reason = self._limits.rejection_reason(len(prompt_token_ids), params.max_tokens)
        if reason is None and constraint is not None:
            try:
                check_constraint(self._info, constraint, params)
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            raise RequestRejectedError(reason)

    def abort(self, request_id: str) -> None:
        for rid in self._groups.get(request_id, [request_id]):
            self._send_abort(rid)

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(tuple(self._snapshots))

    # ---- messages -------------------------------------------------------------------------

    def _send_abort(self, request_id: str) -> None:
        track = self._tracks.get(request_id)
        if track is not None:
            self._outboxes[track.rank].put(AbortRequests((request_id,)))

    def _wire(self, constraint: CompiledConstraint) -> WireConstraint:
        grammar = constraint.grammar
        if not self._vocabulary_sent:
            vocabulary = SetGrammarVocabulary(grammar.tokenizer_info.serialize_json())
            for outbox in self._outboxes:
                outbox.put(vocabulary)
            self._vocabulary_sent = True
        return WireConstraint(constraint.spec, grammar.serialize_json(), constraint.guard)

    def _write(self, rank: int, conn: Connection) -> None:
        outbox = self._outboxes[rank]
        while True:
            message = outbox.get()
            try:
                conn.send(message)
            except OSError:
                return  # the reader reports the lost rank
            if isinstance(message, Stop):
                return

    def _read(self, rank: int, conn: Connection) -> None:
        assert self._loop is not None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._on_lost, rank)
                return
            self._loop.call_soon_threadsafe(self._on_message, rank, message)
            if isinstance(message, RankFailed):
                return

    def _on_message(self, rank: int, message: object) -> None:
        if isinstance(message, StepResult):
            self._snapshots[rank] = message.snapshot
            self._placer.update([_load(s) for s in self._snapshots])
            self._dispatch(message.deltas)
        elif isinstance(message, RankFailed):
            logger.error("engine rank %d failed:\n%s", rank, message.error)
            last = message.error.strip().splitlines()[-1] if message.error.strip() else "?"
            self._fail(f"engine rank {rank} failed ({last})")

    def _on_lost(self, rank: int) -> None:
        if not self._stopping:
            self._fail(f"engine rank {rank} exited unexpectedly")

    def _dispatch(self, deltas: tuple[Delta, ...]) -> None:
        for delta in deltas:
            track = self._tracks.get(delta.request_id)
            if track is None:
                continue
            track.num_output_tokens = delta.num_output_tokens
            track.queue.put_nowait(delta)

    def _fail(self, reason: str) -> None:
        if self._failure is not None or self._stopping:
            return
        logger.error("the engine failed: %s; ending every request", reason)
        self._failure = reason
        self._accepting = False
        self._end_all(f"the engine failed ({reason}); the request was aborted")
        if self._on_failure is not None:
            self._on_failure(reason)

    def _end_all(self, error: str) -> None:
        """Finish every open stream with an ABORT delta carrying `error`."""
        for request_id, track in list(self._tracks.items()):
            track.queue.put_nowait(
                Delta(
                    request_id=request_id,
                    index=track.index,
                    token_ids=[],
                    logprobs=None,
                    num_prompt_tokens=track.num_prompt_tokens,
                    num_output_tokens=track.num_output_tokens,
                    finish_reason=FinishReason.ABORT,
                    error=error,
                )
            )
            del self._tracks[request_id]

    # ---- processes ------------------------------------------------------------------------

    def _join_local(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_local()
        for conn in self._conns.values():
            conn.close()

    def _kill_local(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                logger.warning("killing engine rank process %d", proc.pid)
                proc.kill()
            proc.join(5)


def _load(snapshot: RankSnapshot) -> RankLoad:
    return RankLoad(
        num_seqs=snapshot.num_running + snapshot.num_waiting,
        kv_tokens=snapshot.num_kv_tokens,
        kv_capacity_tokens=snapshot.num_blocks * BLOCK_TOKENS,
        max_seqs=snapshot.num_slots,
    )


def _shared_authkey() -> bytes:
    key = envs.engine_authkey()
    if key is None:
        raise ValueError(
            "several nodes need DEEPINFER_ENGINE_AUTHKEY (the same secret on every node) to "
            "authenticate the ranks' connections to the API process"
        )
    return key


def spawn_ranks(
    device: str,
    parallel: ParallelConfig,
    master_port: int,
    address: tuple[str, int],
    authkey: bytes,
    *,
    drafts: DraftFactory | None = None,
) -> list[mp.Process]:
    """Start this node's ranks (`parallel.local_ranks`) on `device`'s type, each connecting to
    the API process at `address` (which tells it what to serve); drafts: see `RankSpec`."""
    ctx = mp.get_context("spawn")
    device_type = torch.device(device).type
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if visible < parallel.ranks_per_node:
            raise ValueError(
                f"{parallel.ranks_per_node} ranks per node need as many GPUs; this node sees "
                f"{visible} (CUDA_VISIBLE_DEVICES / --ep / --nnodes)"
            )
    num_threads = max(1, (os.cpu_count() or 1) // parallel.ranks_per_node)
    procs = []
    for local_rank, rank in enumerate(parallel.local_ranks):
        spec = RankSpec(
            rank=RankConfig(
                rank=rank,
                world_size=parallel.ep_size,
                master_addr=parallel.master_addr,
                master_port=master_port,
                device_type=device_type,
                local_rank=local_rank,
                timeout_s=parallel.timeout_s,
            ),
            address=address,
            authkey=authkey,
            num_threads=num_threads,
            num_local_ranks=parallel.ranks_per_node,
            drafts=drafts,
        )
        proc = ctx.Process(target=run_rank, args=(spec,), name=f"engine-rank-{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def serve_ranks(device: str, parallel: ParallelConfig) -> int:
    """Run this node's ranks (`--node-rank` > 0) for the API server of node 0 until they exit.

    The ranks connect to node 0's API process (retrying until it listens) and get what to
    serve from it: only the device type and the parallel options are this node's own. They
    exit when node 0 stops them, when node 0 is gone (their collectives fail within
    `timeout_s`), or when this process gets SIGTERM / Ctrl-C (it kills them; node 0 then
    fails and exits). Returns the exit status: 0 when every rank exited cleanly, else 1.
    """
    import signal

    if parallel.node_rank == 0:
        raise ValueError("node 0 runs the API server (MultiProcessEngine), not serve_ranks")
    address = (parallel.master_addr, parallel.engine_port)
    assert parallel.master_port is not None  # ParallelConfig requires it for several nodes
    procs = spawn_ranks(device, parallel, parallel.master_port, address, _shared_authkey())
    logger.info(
        "node %d runs ranks %s: pids %s",
        parallel.node_rank,
        list(parallel.local_ranks),
        [p.pid for p in procs],
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and any(p.is_alive() for p in procs):
        stop.wait(0.5)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    return 0 if all(p.exitcode == 0 for p in procs) else 1
