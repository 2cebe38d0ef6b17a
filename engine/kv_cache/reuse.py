"""The scheduler's prefix-cache collaborator: match at admission, index full blocks as they fill.

Pure Python, no torch. For a waiting request it finds the longest chain of cached blocks of its
tokens (`PrefixCache.match` over the request's chain keys, `hashing.py`) and says where computing
restarts; the scheduler allocates only the rest. What a hit at P = hits × block_tokens restores
and what it recomputes (`cache.md` §1.5):

    tokens       0 ............................................ P ............ S
    blocks       [ cached, shared, read-only global KV + index keys ] [ new blocks ]
    computed                                    [ replay R rows  ][ new rows    ]
                                                ^ window_floor = P − R

The replayed rows rebuild what blocks do not hold (the SWA windows of every layer); they read
the cached global KV, write no global KV, and see no window row below `window_floor`. With
`R >= num_layers × (window − 1)` every window row at P equals a full prefill's (a layer's row
at p depends on the rows of the layer below in (p − window, p]); that is `exact` replay. The
`bounded` replay of V4.1 (R = 128) truncates the windows of the first replayed rows, and runs
the decoder layers on only the last `decoder_tail_tokens` rows of each replaying chunk
(decoder bounded replay, `model.md` §7.1; the runner floors their decoder windows there).

Lower tiers, each optional, looked up in order GPU → host → local dir → shared dir:

* The host tier (`engine/kv_cache/host.py`) holds a copy of every block the GPU tier indexes
  (write-through at `commit`, copied asynchronously), LRU, so a block evicted from the GPU
  stays a hit. `match` extends the GPU hit with the host blocks that continue it; `apply`
  checks their checksums (a corrupt slot ends the hit there), copies them into the request's
  fresh pool blocks (ordered before the request's first step, the host never waits) and
  indexes them.
* The directory tiers (`engine/kv_cache/store/`): where the chain continues past GPU and host,
  `is_ready` starts a lookup of the rest on a reader thread and holds the request in the queue
  ("waiting for KV") until the blocks are loaded or `load_timeout_s` passes; `match` extends
  the hit with the loaded prefix, and `apply` copies those payloads into the request's pool
  blocks and into host slots (promotion) and indexes them.

From there on they are ordinary GPU-tier hits. Every full prompt block the request computes is
written back to the directory tiers (parent before child, on writer threads; a block in the
host tier is written from its host bytes once its copy has landed); blocks it hit in the GPU or
host tier are touched there (a hit in any tier keeps the directory copies alive).

Corner cases (`cache.md` §1.6): a whole prompt in cache still computes its replay rows, the last
of which yields the logits, so no block needs backing off; prompt logprobs do not exist in this
engine; a preempted request re-matches like a new one (its own blocks are usually still cached).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.kv_cache.hashing import KEY_BYTES, chain_seed, combine_salts, extend_chain
from engine.kv_cache.host import CopyHandle, HostBlockPool, HostPoolStats
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.prefix import PrefixCache
from engine.kv_cache.resume import ResumeSlot, ResumeTier
from engine.kv_cache.store.format import BlockIdentity
from engine.kv_cache.store.tiers import BlockTiers, LoadJob, WriteItem
from engine.kv_cache.store.ttl import CHAT
from engine.outputs import PrefixRestore, SlotRestore
from engine.request import Request


@dataclass(frozen=True)
class PrefixReuseConfig:
    """fingerprint: the namespace fingerprint (`hashing.namespace_fingerprint`), 32 bytes.
    replay_tokens: cached positions recomputed before each hit (R above; ≥ 1).
    num_history_tokens: token ids before the replay the model needs (Engram n-gram − 1).
    block_tokens: positions per block (the manager's).
    decoder_tail_tokens: rows of a replaying chunk that run the decoder (0 = all)."""

    fingerprint: bytes
    replay_tokens: int
    num_history_tokens: int = 0
    block_tokens: int = 128
    decoder_tail_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.fingerprint) != KEY_BYTES:
            raise ValueError(f"fingerprint must be {KEY_BYTES} bytes")
        if self.replay_tokens < 1 or self.num_history_tokens < 0 or self.block_tokens < 1:
            raise ValueError(
                "PrefixReuseConfig: replay_tokens >= 1, num_history_tokens >= 0, block_tokens >= 1"
            )
        if self.decoder_tail_tokens < 0:
            raise ValueError("PrefixReuseConfig: decoder_tail_tokens >= 0")


class BlockPayloads(Protocol):
    """The runner's copies of pool blocks in the canonical block layout (`cache.md` §1.3), to
    and from bytes (the directory tiers) and host slots (the host tier)."""

    def export(self, blocks: Sequence[int]) -> list[bytes]: ...

    def load(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None: ...

    def save(self, blocks: Sequence[int], slots: Sequence[Any]) -> CopyHandle:
        """Copy pool blocks into host slot views (uint8 tensors), asynchronously where the
        device allows; pool writes issued later never overtake the copy."""
        ...

    def restore(self, slots: Sequence[Any], blocks: Sequence[int]) -> CopyHandle:
        """Copy host slot views into pool blocks, ordered before the next step; the slots must
        stay unchanged until the handle is done."""
        ...


@dataclass(frozen=True)
class HostTier:
    """The host tier as the reuse collaborator uses it: the pool and the runner's copies."""

    pool: HostBlockPool
    payloads: BlockPayloads


@dataclass(frozen=True)
class StoreTiers:
    """The directory tiers as the reuse collaborator uses them.

    tiers: the stores and their worker threads. payloads: the runner's block copies.
    load_timeout_s: the longest a request waits in the queue for its blocks (then it proceeds
    with the prefix loaded so far). clock: monotonic seconds, for that deadline."""

    tiers: BlockTiers
    payloads: BlockPayloads
    load_timeout_s: float = 2.0
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(frozen=True)
class CacheHit:
    """The blocks a request reuses and where its computing restarts (both 0 on a miss).

    blocks: GPU-tier blocks (shared). num_host_blocks: the next blocks of the chain, in the
    host tier. loaded: payloads of the blocks after those, read from the directory tiers
    (`apply` copies host and loaded blocks into the request's own blocks); `loaded_tiers`
    names the tier of each. num_cached_tokens covers all three (`apply` may shorten the hit
    when a host slot turns out corrupt)."""

    blocks: tuple[int, ...]
    num_cached_tokens: int  # P
    replay_start: int  # P − R
    loaded: tuple[bytes, ...] = ()
    loaded_tiers: tuple[str, ...] = ()
    num_host_blocks: int = 0
    resume: ResumeSlot | None = None  # the resume slot restoring [P0, L): then P = L


@dataclass(frozen=True)
class PrefixReuseStats:
    """Counters since start, in tokens: prompt (and preempted output) tokens looked up, tokens
    restored from cached blocks, cached tokens recomputed by replay; restored tokens by the
    tier they came from (`gpu`, `host`, `local`, `shared`); the host pool's own counters."""

    num_queried_tokens: int
    num_hit_tokens: int
    num_replayed_tokens: int
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    host: HostPoolStats | None = None


@dataclass
class _Lookup:
    """A waiting request's directory lookup: the job reads chain blocks `first ..`."""

    job: LoadJob
    first: int
    deadline: float


@dataclass
class _PendingWrite:
    """A write-back segment waiting for host copies to land: per block, the payload to write
    (None: touch only) or `_FROM_HOST` (its host bytes)."""

    chain: str
    blocks: list[BlockIdentity]
    payloads: list[bytes | object | None]
    traffic_class: str


_FROM_HOST = object()


class PrefixReuse:
    """Match, apply and index; one instance per scheduler (it shares the manager's cache)."""

    def __init__(
        self,
        config: PrefixReuseConfig,
        kv_manager: KVCacheManager,
        store: StoreTiers | None = None,
        host: HostTier | None = None,
        resume: ResumeTier | None = None,
    ) -> None:
        """store: the directory tiers (None: none). host: the host tier (None: none).
        resume: the resume slots of finished sequences (`resume.py`; None: none kept)."""
        if kv_manager.prefix_cache is None:
            raise ValueError("the KVCacheManager has no PrefixCache attached")
        if kv_manager.config.block_tokens != config.block_tokens:
            raise ValueError("PrefixReuseConfig.block_tokens differs from the manager's")
        self.config = config
        self.kv_manager = kv_manager
        self.cache: PrefixCache = kv_manager.prefix_cache
        self.store = store
        self.host = host
        self._pending_writes: deque[_PendingWrite] = deque()
        self.resume = resume
        self._num_queried = 0
        self._num_hit = 0
        self._num_replayed = 0
        self._hit_by_tier: dict[str, int] = {}
        self._lookups: dict[str, _Lookup] = {}  # waiting request id → its directory lookup
        self._settled: set[str] = set()  # waiting requests whose lookup is over

    @property
    def num_waiting_for_kv(self) -> int:
        """Waiting requests whose directory lookup is still running."""
        return sum(1 for rid in self._lookups if rid not in self._settled)

    def is_ready(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now: its directory lookup and its pull
        of another server's resume slot (`ResumeTier.is_ready`), if any, are over."""
        slot_ready = self.resume is None or self.resume.is_ready(
            request, self._keys(request), self._seed(request)
        )
        return self._is_store_ready(request) and slot_ready

    def _is_store_ready(self, request: Request) -> bool:
        """Whether the request's directory lookup is over (always, without directory tiers).

        Mutates: the first call for a request whose chain continues past the GPU tier starts
        a directory lookup (the request is then waiting for KV); it is ready once the lookup
        is done or its deadline passed. Nothing here waits on I/O."""
        rid = request.request_id
        self.poll()
        if self.store is None or rid in self._settled:
            return True
        lookup = self._lookups.get(rid)
        if lookup is None:
            keys = self._keys(request)
            num_fast = self._num_fast(keys)
            if num_fast >= len(keys):
                self._settled.add(rid)
                return True
            blocks = self._identities(request, num_fast, len(keys))
            job = self.store.tiers.start_load(blocks, _traffic_class(request))
            deadline = self.store.clock() + self.store.load_timeout_s
            self._lookups[rid] = _Lookup(job, num_fast, deadline)
            return False
        if lookup.job.done.is_set() or self.store.clock() >= lookup.deadline:
            lookup.job.cancel()  # at the deadline: keep the prefix loaded so far
            self._settled.add(rid)
            return True
        return False

    def match(self, request: Request) -> CacheHit:
        """The longest cached chain of the request's tokens (prompt + outputs so far): GPU
        blocks, then host blocks, then the blocks its directory lookup loaded, each where it
        continues the one before.

        Mutates only the request's lazily extended `block_keys`. The hit may cover every token:
        the replay starts before P, so at least its rows are computed and the last one yields
        the logits.
        """
        keys = self._keys(request)
        blocks = self.cache.match(keys)
        num_host = 0 if self.host is None else self.host.pool.match(keys[len(blocks) :])
        num_fast = len(blocks) + num_host
        loaded: list[bytes] = []
        tiers: list[str] = []
        lookup = self._lookups.get(request.request_id)
        if lookup is not None and lookup.first <= num_fast:
            skip = num_fast - lookup.first  # GPU or host blocks that appeared meanwhile
            loaded = lookup.job.payloads()[skip:]
            tiers = lookup.job.tiers()[skip : skip + len(loaded)]
        num_cached = (num_fast + len(loaded)) * self.config.block_tokens
        replay_start = max(0, num_cached - self.config.replay_tokens)
        slot = (
            None
            if self.resume is None
            else self.resume.find(request, keys, self._seed(request), num_fast + len(loaded))
        )
        if slot is not None and slot.length >= replay_start:  # exact, and computes no more
            num_blocks = slot.num_boundary_tokens // self.config.block_tokens
            num_gpu = min(len(blocks), num_blocks)
            num_host_used = min(num_host, num_blocks - num_gpu)
            num_loaded = num_blocks - num_gpu - num_host_used
            return CacheHit(
                tuple(blocks[:num_gpu]),
                slot.length,
                slot.length,
                loaded=tuple(loaded[:num_loaded]),
                loaded_tiers=tuple(tiers[:num_loaded]),
                num_host_blocks=num_host_used,
                resume=slot,
            )
        return CacheHit(
            blocks=tuple(blocks),
            num_cached_tokens=num_cached,
            replay_start=max(0, num_cached - self.config.replay_tokens),
            loaded=tuple(loaded),
            loaded_tiers=tuple(tiers),
            num_host_blocks=num_host,
        )

    def apply(self, request: Request, hit: CacheHit) -> None:
        """The request was admitted holding `hit.blocks` (and fresh blocks after them): copy
        its host blocks, then `hit.loaded`, into its next blocks and index them (loaded blocks
        also enter the host tier), refresh its GPU and host hit blocks in the lower tiers, and
        start computing at the replay.

        A host slot that fails its checksum ends the hit there (the blocks after it are
        computed). Mutates the request (`num_computed_tokens` and the reuse fields), the
        caches and the counters."""
        self.release(request)
        keys = self._keys(request)
        table = self.kv_manager.block_table(request.request_id)
        num_gpu = len(hit.blocks)
        num_host = self._restore_from_host(keys, table, num_gpu, hit.num_host_blocks)
        first = num_gpu + num_host
        loaded = hit.loaded if num_host == hit.num_host_blocks else ()
        if loaded:
            assert self.store is not None
            targets = table[first : first + len(loaded)]
            self.store.payloads.load(targets, loaded)
            for index, block in enumerate(targets, start=first):
                self.cache.insert(keys[index], block)
            if self.host is not None:
                for key, payload, tier in zip(keys[first:], loaded, hit.loaded_tiers, strict=False):
                    self.host.pool.put_bytes(key, payload, tier)
        num_cached = (first + len(loaded)) * self.config.block_tokens
        replay_start = max(0, num_cached - self.config.replay_tokens)
        # A resume needs every block below its boundary (a corrupt host block ends the run).
        slot = hit.resume
        if slot is not None and num_cached != slot.num_boundary_tokens:
            slot = None
        if self.resume is not None:
            self.resume.admit(request, slot)
        if slot is not None:
            num_cached = replay_start = slot.length
        request.num_reused_tokens = num_cached
        request.replay_start = replay_start
        request.num_computed_tokens = replay_start
        request.num_indexed_blocks = first + len(loaded)
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
        self._num_queried += request.num_tokens
        self._num_hit += num_cached
        self._num_replayed += num_cached - replay_start
        by_tier = ("gpu",) * num_gpu + ("host",) * num_host + hit.loaded_tiers[: len(loaded)]
        for tier in by_tier:
            self._hit_by_tier[tier] = self._hit_by_tier.get(tier, 0) + self.config.block_tokens
        if slot is not None:
            num_tail = len(slot.tail_token_ids)
            self._hit_by_tier["resume"] = self._hit_by_tier.get("resume", 0) + num_tail
        if self.host is not None:
            self.host.pool.touch(keys[:num_gpu])  # a GPU hit keeps the host copy recent too
        if self.store is not None and first:
            self._write_back(request, 0, first, is_hit=True)

    def _restore_from_host(
        self, keys: Sequence[bytes], table: Sequence[int], first: int, num: int
    ) -> int:
        """Copy the host blocks of chain blocks `first .. first + num − 1` into the request's
        pool blocks there and index them; returns how many were intact (a corrupt slot ends
        the run)."""
        if self.host is None or num == 0:
            return 0
        pool = self.host.pool
        wanted = keys[first : first + num]
        views = pool.read(wanted)
        if not views:
            return 0
        targets = table[first : first + len(views)]
        pool.pin(wanted[: len(views)], self.host.payloads.restore(views, targets))
        for index, block in enumerate(targets, start=first):
            self.cache.insert(keys[index], block)
        return len(views)

    def restore_info(self, request: Request, start_position: int) -> PrefixRestore | None:
        """What a chunk starting at `start_position` must know about the hit (None when it
        starts past the cached positions: from there on the request runs as a plain prefill;
        NOTE: that needs `replay_tokens >= window − 1` or a start at 0, checked by the builder).
        """
        if start_position >= request.num_reused_tokens:
            return None
        floor = request.replay_start
        history = ()
        if start_position == floor:
            first = max(0, floor - self.config.num_history_tokens)
            history = tuple(request.all_token_ids[first:floor])
        return PrefixRestore(
            floor, request.num_reused_tokens, history, self.config.decoder_tail_tokens
        )

    def commit(self, request: Request) -> None:
        """Index the request's blocks whose positions are now all computed and whose tokens are
        known, and queue its new full prompt blocks for the directory tiers.

        Mutates: new full blocks enter the cache (a block whose prefix another block already
        holds stays unindexed); `request.num_indexed_blocks` advances; a resume slot whose
        restore has run is released. O(1) unless a block filled: host copies that landed are
        finished by `poll` (the scheduler polls once per step) and here only when a block is
        indexed."""
        if self.resume is not None and request.resume_slot is not None:
            self.resume.applied(request)
        # Accepted drafts are computed before `update` appends them: index known tokens only.
        known = min(request.num_computed_tokens, request.num_tokens)
        num_full = known // self.config.block_tokens
        if num_full <= request.num_indexed_blocks:
            return
        self.poll()
        keys = self._keys(request)
        block_table = self.kv_manager.block_table(request.request_id)
        first = request.num_indexed_blocks
        for index in range(first, num_full):
            self.cache.insert(keys[index], block_table[index])
        request.num_indexed_blocks = num_full
        if self.host is not None:
            blocks = block_table[first:num_full]
            payloads = self.host.payloads
            self.host.pool.put(
                keys[first:num_full],
                lambda indices, slots: payloads.save([blocks[i] for i in indices], slots),
                "gpu",
            )
        if self.store is not None:
            self._write_back(request, first, num_full, is_hit=False)

    def poll(self) -> None:
        """Finish host copies that have landed and submit the write-backs that waited for
        them (in order). Never waits; called at every admission and commit.
        NOTE: on an idle engine, write-backs waiting for a copy wait for the next request
        (or `close`)."""
        if self.host is not None:
            self.host.pool.poll()
        while self._pending_writes:
            pending = self._pending_writes[0]
            items = []
            for block, payload in zip(pending.blocks, pending.payloads, strict=True):
                if payload is _FROM_HOST:
                    assert self.host is not None
                    if self.host.pool.is_filling(block.key):
                        return  # its copy has not landed yet
                    payload = self.host.pool.payload(block.key)  # None (evicted): touch only
                assert payload is None or isinstance(payload, bytes)
                items.append(WriteItem(block, payload))
            assert self.store is not None
            self.store.tiers.write_back(pending.chain, items, pending.traffic_class)
            self._pending_writes.popleft()

    def close(self) -> None:
        """Shutdown: wait for the host copies in flight, submit the write-backs waiting for
        them, then stop the directory tiers' threads (after their queued writes)."""
        if self.host is not None:
            self.host.pool.wait()
            self.poll()
        if self.store is not None:
            self.store.tiers.close()

    def forget(self, request: Request) -> None:
        """The request lost its blocks (preempted): reset what described its admission."""
        request.num_reused_tokens = request.replay_start = request.num_indexed_blocks = 0
        if self.resume is not None:
            self.resume.drop(request)

    def release(self, request: Request) -> None:
        """The request left the waiting queue (admitted or finished): drop its directory
        lookup, if any."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is not None:
            lookup.job.cancel()
        self._settled.discard(request.request_id)
        if self.resume is not None:
            self.resume.drop(request)
            self.resume.forget_wait(request)

    def resume_info(self, request: Request, start_position: int) -> SlotRestore | None:
        """The resume slot the chunk starting at `start_position` copies back first (only the
        first chunk of a request admitted from a slot), or None."""
        if self.resume is None or request.resume_slot is None:
            return None
        table = self.kv_manager.block_table(request.request_id)
        return self.resume.restore(request, start_position, table)

    def retire(self, request: Request) -> None:
        """A running request finished (not aborted): snapshot its state into a resume slot
        while it still holds its state slot and blocks. Mutates the resume pool only."""
        if self.resume is None or not self.kv_manager.is_allocated(request.request_id):
            return
        rid = request.request_id
        keys, seed = self._keys(request), self._seed(request)
        table = self.kv_manager.block_table(rid)
        self.resume.retire(request, keys, seed, self.kv_manager.slot(rid), table)

    def stats(self) -> PrefixReuseStats:
        return PrefixReuseStats(
            self._num_queried,
            self._num_hit,
            self._num_replayed,
            dict(self._hit_by_tier),
            None if self.host is None else self.host.pool.stats(),
        )

    def check_request(self, request: Request) -> None:
        """Raise AssertionError unless a running request's indexed blocks carry its chain keys.
        No mutation (except the request's lazily extended keys)."""
        keys = self._keys(request)
        block_table = self.kv_manager.block_table(request.request_id)
        for index in range(request.num_indexed_blocks):
            key = self.cache.key_of(block_table[index])
            if key is not None and key != keys[index]:
                raise AssertionError(
                    f"PrefixReuse integrity: block {index} of {request.request_id!r} is cached "
                    "under another prefix's key"
                )

    def _num_fast(self, keys: Sequence[bytes]) -> int:
        """Leading chain blocks in the GPU tier, then the host tier (no I/O)."""
        num = len(self.cache.match(keys))
        return num if self.host is None else num + self.host.pool.match(keys[num:])

    def _keys(self, request: Request) -> list[bytes]:
        return extend_chain(
            request.block_keys, self._seed(request), request.all_token_ids, self.config.block_tokens
        )

    def _seed(self, request: Request) -> bytes:
        return chain_seed(self.config.fingerprint, combine_salts(request.cache_salt))

    def _identities(self, request: Request, first: int, end: int) -> list[BlockIdentity]:
        """What blocks `first .. end − 1` of the request's chain are, for the directory tiers."""
        bt = self.config.block_tokens
        keys, tokens = self._keys(request), request.all_token_ids
        seed, namespace = self._seed(request), self.config.fingerprint[:16]
        out = []
        for i in range(first, end):
            block_tokens = tuple(tokens[i * bt : (i + 1) * bt])
            out.append(
                BlockIdentity(namespace, keys[i], keys[i - 1] if i else seed, i, block_tokens)
            )
        return out

    def _write_back(self, request: Request, first: int, end: int, *, is_hit: bool) -> None:
        """Queue the request's prompt blocks `first .. end − 1` for the directory tiers: hit
        blocks every tier remembers are only touched, the others are exported and written (a
        write of a block that exists is a touch). Output blocks are not written."""
        assert self.store is not None
        end = min(end, request.num_prompt_tokens // self.config.block_tokens)
        if end <= first:
            return
        blocks = self._identities(request, first, end)
        table = self.kv_manager.block_table(request.request_id)
        tiers = self.store.tiers
        host = None if self.host is None else self.host.pool
        payloads: list[bytes | object | None] = [None] * len(blocks)
        exported = []
        for i, block in enumerate(blocks):
            if is_hit and tiers.believes_present(block):
                continue  # touched only
            if host is not None and host.contains(block.key):
                payloads[i] = _FROM_HOST
            else:
                exported.append(i)
        copies = self.store.payloads.export([table[first + i] for i in exported])
        for i, payload in zip(exported, copies, strict=True):
            payloads[i] = payload
        self._pending_writes.append(
            _PendingWrite(request.request_id, blocks, payloads, _traffic_class(request))
        )
        self.poll()


def _traffic_class(request: Request) -> str:
    return request.traffic_class or CHAT
