"""Block-level simulator of one directory tier (`cache.md` §5.1 "Simulator", §2.4).

Replays the seeded traces of `loadtest.traces` as 128-token block keys (the engine's own chain
hash, `engine.kv_cache.hashing`) over simulated time against a tier of a given capacity, with
the engine's TTL policy (`engine.kv_cache.store.ttl.TTLPolicy`: deadline = last access +
TTL(class), only ever extended, touches rate-limited) and the directory GC's rule (expired
first, then earliest deadline, deeper first within a touch granule, from the high watermark
down to the low one).

Per request: the longest chain of unexpired blocks is a hit (every hit block is touched with
the request's class), the rest of the prompt's full blocks are written; agent sessions also
write the blocks of their output (reasoning and call stay in history with tools, §2.6), chat
sessions do not (history drops the reasoning). The next turn arrives after the request's
service time (`decode_s_per_token` × output) plus the trace's think time.

Two backends with one interface: `MemoryTier` (dicts and a heap; millions of block accesses
in seconds) and `DirTier` (the real `DirBlockStore` on a directory with an injected clock;
small traces only), so a test can check that the model equals the store.

    python -m loadtest.cachesim --days 21 --warmup-days 7 --chat-ttl 7d 3d --capacity-blocks 0
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.kv_cache.hashing import block_key, chain_seed, namespace_fingerprint
from engine.kv_cache.store.ttl import AGENT, CHAT, TTLPolicy
from loadtest.traces import (
    AgentTraceConfig,
    ChatTraceConfig,
    History,
    Segment,
    TraceSession,
    agent_trace,
    chat_trace,
)

BLOCK_TOKENS = 128
EPOCH = 1.8e9  # simulated unix time of the trace start (the directory backend's mtimes)
_FINGERPRINT = namespace_fingerprint({"simulator": "loadtest.cachesim"})
_SEED = chain_seed(_FINGERPRINT)


@dataclass
class Chain:
    """The full blocks of one token sequence: keys[i] covers tokens [128 i, 128 (i + 1))."""

    keys: list[bytes]
    tokens: np.ndarray

    def parent(self, depth: int) -> bytes:
        return self.keys[depth - 1] if depth else _SEED

    def block_tokens(self, depth: int) -> tuple[int, ...]:
        return tuple(self.tokens[depth * BLOCK_TOKENS : (depth + 1) * BLOCK_TOKENS].tolist())


class Tier(Protocol):
    """What the simulator needs of a tier; `now` is simulated unix seconds."""

    def lookup(self, chain: Chain, traffic_class: str, now: float) -> int:
        """Blocks of the longest unexpired prefix of `chain` (each touched with the class)."""

    def write(self, chain: Chain, depth: int, traffic_class: str, now: float) -> None:
        """Publish block `depth` of `chain` (a touch when it is there unexpired)."""

    def collect(self, now: float) -> None:
        """The background GC's pass: drop expired blocks (and evict above the watermark)."""

    def counts(self) -> dict[str, int]:
        """blocks (now), expired, evicted (since start)."""


class MemoryTier:
    """An in-memory model of `DirBlockStore` + its GC, block granular (`capacity_blocks` 0:
    unbounded). Same decisions as the store; no files."""

    def __init__(
        self,
        policy: TTLPolicy,
        capacity_blocks: int = 0,
        high_watermark: float = 0.90,
        low_watermark: float = 0.80,
    ) -> None:
        self.policy = policy
        self.capacity = capacity_blocks
        self.high, self.low = high_watermark, low_watermark
        self._deadline: dict[bytes, float] = {}
        self._depth: dict[bytes, int] = {}
        # (eviction rank, key), lazy: the rank is `TTLPolicy.eviction_rank`, the GC's order
        self._heap: list[tuple[tuple[float, int, float], bytes]] = []
        self.expired = 0
        self.evicted = 0

    def lookup(self, chain: Chain, traffic_class: str, now: float) -> int:
        found = 0
        for key in chain.keys:
            deadline = self._deadline.get(key)
            if deadline is None or deadline <= now:
                break
            self._touch(key, deadline, traffic_class, now)
            found += 1
        return found

    def write(self, chain: Chain, depth: int, traffic_class: str, now: float) -> None:
        key = chain.keys[depth]
        deadline = self._deadline.get(key)
        if deadline is not None and deadline > now:
            self._touch(key, deadline, traffic_class, now)
            return
        if deadline is not None:  # expired, not yet collected: replaced
            self._drop(key)
            self.expired += 1
        self._set(key, depth, now + self.policy.ttl(traffic_class))
        if self.capacity and len(self._deadline) > self.high * self.capacity:
            self.collect(now)

    def collect(self, now: float) -> None:
        # Expired first: every entry of an earlier granule than `now`'s, and those of `now`'s
        # own granule whose deadline passed (the unexpired ones there go back).
        granule = self.policy.eviction_rank(now, 0)[0]
        kept = []
        while self._heap and self._heap[0][0][0] <= granule:
            rank, key = self._heap[0]
            if rank[2] > now:
                kept.append(heapq.heappop(self._heap))
            elif self._pop_current() is not None:
                self.expired += 1
        for entry in kept:
            heapq.heappush(self._heap, entry)
        if not self.capacity or len(self._deadline) <= self.high * self.capacity:
            return
        while self._heap and len(self._deadline) > self.low * self.capacity:
            if self._pop_current() is not None:
                self.evicted += 1

    def counts(self) -> dict[str, int]:
        return {"blocks": len(self._deadline), "expired": self.expired, "evicted": self.evicted}

    def _touch(self, key: bytes, deadline: float, traffic_class: str, now: float) -> None:
        wanted = now + self.policy.ttl(traffic_class)
        if wanted - deadline >= self.policy.min_extend(traffic_class):
            self._set(key, self._depth[key], wanted)

    def _set(self, key: bytes, depth: int, deadline: float) -> None:
        self._deadline[key] = deadline
        self._depth[key] = depth
        heapq.heappush(self._heap, (self.policy.eviction_rank(deadline, depth), key))

    def _drop(self, key: bytes) -> None:
        del self._deadline[key]
        del self._depth[key]

    def _pop_current(self) -> bytes | None:
        rank, key = heapq.heappop(self._heap)
        if self._deadline.get(key) != rank[2]:
            return None  # superseded by a touch, or already deleted
        self._drop(key)
        return key


class DirTier:
    """The real `DirBlockStore` (engine code) on `root`, clock injected, 1-byte payloads;
    GC is run where the engine's background worker would (before each request, and when a
    write asks for it)."""

    def __init__(self, root: str, policy: TTLPolicy, capacity_blocks: int) -> None:
        from engine.kv_cache.store.dirstore import DirBlockStore, DirStoreConfig
        from engine.kv_cache.store.format import file_size

        self.now = EPOCH
        max_bytes = capacity_blocks * file_size(1) if capacity_blocks else 1 << 50
        config = DirStoreConfig(root=root, tier="sim", max_bytes=max_bytes, min_free_bytes=0)
        self.store = DirBlockStore(
            config,
            fingerprint=_FINGERPRINT,
            namespace_fields={"simulator": "loadtest.cachesim"},
            payload_len=1,
            policy=policy,
            clock=lambda: self.now,
        )
        self._gc_wanted = False
        self.store.on_gc_needed = functools.partial(setattr, self, "_gc_wanted", True)

    def _identity(self, chain: Chain, depth: int):
        from engine.kv_cache.store.format import BlockIdentity

        return BlockIdentity(
            self.store.namespace,
            chain.keys[depth],
            chain.parent(depth),
            depth,
            chain.block_tokens(depth),
        )

    def lookup(self, chain: Chain, traffic_class: str, now: float) -> int:
        self.now = now
        found = 0
        for depth in range(len(chain.keys)):
            if self.store.read(self._identity(chain, depth)) is None:
                break
            self.store.touch(chain.keys[depth], depth, traffic_class)
            found += 1
        return found

    def write(self, chain: Chain, depth: int, traffic_class: str, now: float) -> None:
        self.now = now
        self.store.write(self._identity(chain, depth), b"\x01", traffic_class)
        if self._gc_wanted:
            self._gc_wanted = False
            self.store.gc_once()

    def collect(self, now: float) -> None:
        self.now = now
        self.store.gc_once()

    def counts(self) -> dict[str, int]:
        stats = self.store.stats()
        return {"blocks": stats.num_blocks, "expired": stats.expired, "evicted": stats.evicted}


# ---------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class SimConfig:
    """warmup_s: requests before this (trace seconds) are replayed but not counted; end_s:
    requests from this time on are not replayed. gc_interval_s: how often the background GC
    pass runs (simulated seconds)."""

    warmup_s: float = 0.0
    end_s: float = float("inf")
    decode_s_per_token: float = 0.02
    gc_interval_s: float = 60.0
    write_outputs: tuple[str, ...] = (AGENT,)


@dataclass
class SimResult:
    """Token counts after warm-up, by traffic class, and per request (session, turn, class,
    prompt tokens, hit tokens) in replay order."""

    prompt: dict[str, int] = field(default_factory=dict)
    hit: dict[str, int] = field(default_factory=dict)
    requests: list[tuple[int, int, str, int, int]] = field(default_factory=list)
    tier: dict[str, int] = field(default_factory=dict)

    def hit_rate(self, traffic_class: str | None = None) -> float:
        classes = [traffic_class] if traffic_class else list(self.prompt)
        prompt = sum(self.prompt.get(c, 0) for c in classes)
        return sum(self.hit.get(c, 0) for c in classes) / prompt if prompt else 0.0


@functools.lru_cache(maxsize=4096)
def _token_ids(segment: Segment) -> np.ndarray:
    return segment.token_ids()


class _ChainBuilder:
    """Keys of a session's successive prompts, hashing only blocks not seen in its last one
    (and a system prompt's blocks once per trace)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[list[Segment], Chain]] = {}
        self._systems: dict[str, Chain] = {}

    def chain(self, session: int, segments: list[Segment]) -> Chain:
        previous = self._last.get(session)
        if previous is None:
            system = segments[0]
            if system.seed not in self._systems:
                self._systems[system.seed] = _extend([system], None, 0)
            previous = ([system], self._systems[system.seed])
        common = 0
        for old, new in zip(previous[0], segments, strict=False):
            if old != new:
                break
            common += old.num_tokens
        chain = _extend(segments, previous[1], common // BLOCK_TOKENS)
        self._last[session] = (segments, chain)
        return chain

    def forget(self, session: int) -> None:
        self._last.pop(session, None)


def _extend(segments: list[Segment], base: Chain | None, keep: int) -> Chain:
    tokens = np.concatenate([_token_ids(s) for s in segments])
    keys = list(base.keys[:keep]) if base is not None else []
    for depth in range(len(keys), len(tokens) // BLOCK_TOKENS):
        parent = keys[depth - 1] if depth else _SEED
        block = tokens[depth * BLOCK_TOKENS : (depth + 1) * BLOCK_TOKENS]
        keys.append(block_key(parent, block.tolist()))
    return Chain(keys, tokens)


def simulate(sessions: Sequence[TraceSession], tier: Tier, config: SimConfig) -> SimResult:
    """Replay `sessions` (any mix of agent and chat) through `tier` in time order."""
    result = SimResult()
    builder = _ChainBuilder()
    histories = {s.index * 2 + (s.kind == CHAT): History(s) for s in sessions}
    order = itertools.count()
    events = [
        (s.start_s, next(order), s.index * 2 + (s.kind == CHAT), 0) for s in sessions
    ]  # (time, tie, session id, turn)
    heapq.heapify(events)
    next_gc = 0.0
    while events:
        when, _, sid, turn_index = heapq.heappop(events)
        if when >= config.end_s:
            break
        history = histories[sid]
        session = history.session
        now = EPOCH + when
        while next_gc <= when:
            tier.collect(EPOCH + next_gc)
            next_gc += config.gc_interval_s
        cls = session.traffic_class
        segments = history.advance(turn_index)
        chain = builder.chain(sid, segments)
        hit = tier.lookup(chain, cls, now)
        for depth in range(hit, len(chain.keys)):
            tier.write(chain, depth, cls, now)
        prompt_len = len(chain.tokens)
        if when >= config.warmup_s:
            result.prompt[cls] = result.prompt.get(cls, 0) + prompt_len
            result.hit[cls] = result.hit.get(cls, 0) + hit * BLOCK_TOKENS
            result.requests.append((session.index, turn_index, cls, prompt_len, hit * BLOCK_TOKENS))
        history.answer(turn_index)
        if cls in config.write_outputs:
            with_output = builder.chain(sid, list(history.segments))
            for depth in range(len(chain.keys), len(with_output.keys)):
                tier.write(with_output, depth, cls, now)
        turn = session.turns[turn_index]
        if turn_index + 1 < len(session.turns):
            done = when + turn.output_tokens * config.decode_s_per_token
            think = session.turns[turn_index + 1].think_s
            heapq.heappush(events, (done + think, next(order), sid, turn_index + 1))
        else:
            builder.forget(sid)
            del histories[sid]
    result.tier = tier.counts()
    return result


# ---------------------------------------------------------------------------- CLI


def _ttl(text: str) -> float:
    return TTLPolicy.parse(f"x={text},agent=1s,chat=1s").ttl("x")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.cachesim", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--days", type=float, default=21.0, help="trace length")
    p.add_argument("--warmup-days", type=float, default=7.0, help="not counted")
    p.add_argument("--agent-sessions-per-day", type=float, default=40.0)
    p.add_argument("--chat-sessions-per-day", type=float, default=1500.0)
    p.add_argument("--agent-turns", type=float, default=20.0, help="mean turns")
    p.add_argument("--revisit-probability", type=float, nargs="+", default=[0.3])
    p.add_argument("--revisit-median-days", type=float, default=1.0)
    p.add_argument(
        "--chat-question-tokens", type=int, default=60, help="median user message (pasted text)"
    )
    p.add_argument("--agent-ttl", default="3d")
    p.add_argument("--chat-ttl", nargs="+", default=["7d", "3d"])
    p.add_argument(
        "--capacity-blocks", type=int, nargs="+", default=[0], help="0: unbounded (TTL only)"
    )
    p.add_argument("--backend", choices=("memory", "dir"), default="memory")
    return p


def traces(args: argparse.Namespace, revisit_probability: float) -> list[TraceSession]:
    seconds = args.days * 86400
    agents = AgentTraceConfig(
        seed=args.seed,
        num_sessions=max(1, int(args.agent_sessions_per_day * args.days)),
        session_rate=args.agent_sessions_per_day / 86400,
        turns_mean=args.agent_turns,
    )
    chats = ChatTraceConfig(
        seed=args.seed,
        num_sessions=max(1, int(args.chat_sessions_per_day * args.days)),
        session_rate=args.chat_sessions_per_day / 86400,
        revisit_probability=revisit_probability,
        revisit_median_s=args.revisit_median_days * 86400,
        question_median=args.chat_question_tokens,
        question_max=max(4096, 8 * args.chat_question_tokens),
    )
    sessions = agent_trace(agents) + chat_trace(chats)
    return [s for s in sessions if s.start_s < seconds]


def run(
    sessions: Sequence[TraceSession],
    policy: TTLPolicy,
    capacity_blocks: int,
    config: SimConfig,
    backend: str = "memory",
) -> SimResult:
    if backend == "memory":
        return simulate(sessions, MemoryTier(policy, capacity_blocks), config)
    with tempfile.TemporaryDirectory(prefix="cachesim-") as root:
        return simulate(sessions, DirTier(os.path.join(root, "tier"), policy, capacity_blocks),
                        config)  # fmt: skip


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = parser().parse_args(argv)
    config = SimConfig(warmup_s=args.warmup_days * 86400, end_s=args.days * 86400)
    out(
        f"{'revisit p':>9} {'capacity':>10} {'agent TTL':>9} {'chat TTL':>8} "
        f"{'hit all':>8} {'agent':>7} {'chat':>7} {'Δ all':>7} {'Δ chat':>7} "
        f"{'blocks':>9} {'expired':>9} {'evicted':>9}"
    )
    for revisit in args.revisit_probability:
        sessions = traces(args, revisit)
        for capacity in args.capacity_blocks:
            base: SimResult | None = None
            for chat_ttl in args.chat_ttl:
                policy = TTLPolicy.parse(f"agent={args.agent_ttl},chat={chat_ttl}")
                result = run(sessions, policy, capacity, config, args.backend)
                base = base or result
                delta_all = result.hit_rate() - base.hit_rate()
                delta_chat = result.hit_rate(CHAT) - base.hit_rate(CHAT)
                out(
                    f"{revisit:>9.2f} {capacity or 'unbounded':>10} {args.agent_ttl:>9} "
                    f"{chat_ttl:>8} {result.hit_rate():>8.2%} {result.hit_rate(AGENT):>7.2%} "
                    f"{result.hit_rate(CHAT):>7.2%} {delta_all:>+7.2%} {delta_chat:>+7.2%} "
                    f"{result.tier['blocks']:>9} {result.tier['expired']:>9} "
                    f"{result.tier['evicted']:>9}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
