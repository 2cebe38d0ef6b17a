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

Directory tiers (`engine/kv_cache/store/`, optional): on a GPU-tier miss `is_ready` starts a
lookup of the rest of the chain on a reader thread and holds the request in the queue ("waiting
for KV") until the blocks are loaded or `load_timeout_s` passes; `match` then extends the GPU
hit with the loaded prefix, and `apply` copies those payloads into the request's fresh pool
blocks and indexes them, so from there on they are ordinary GPU-tier hits. Every full prompt
block the request computes is written back (parent before child, on writer threads); blocks it
hit are touched there (a hit in any tier keeps the directory copies alive).

Corner cases (`cache.md` §1.6): a whole prompt in cache still computes its replay rows, the last
of which yields the logits, so no block needs backing off; prompt logprobs do not exist in this
engine; a preempted request re-matches like a new one (its own blocks are usually still cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_cache.hashing import KEY_BYTES, chain_seed, combine_salts, extend_chain
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.prefix import PrefixCache
from engine.kv_cache.store.format import BlockIdentity
from engine.kv_cache.store.tiers import BlockTiers, LoadJob, WriteItem
from engine.kv_cache.store.ttl import CHAT
from engine.outputs import PrefixRestore
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
    """The runner's copy of pool blocks to and from bytes (`state.export_block`)."""

    def export(self, blocks: Sequence[int]) -> list[bytes]: ...

    def load(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None: ...


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

    blocks: GPU-tier blocks (shared). loaded: payloads of the next blocks of the chain, read
    from the directory tiers (`apply` copies them into the request's own blocks);
    `loaded_tiers` names the tier of each. num_cached_tokens covers both."""

    blocks: tuple[int, ...]
    num_cached_tokens: int  # P
    replay_start: int  # P − R
    loaded: tuple[bytes, ...] = ()
    loaded_tiers: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrefixReuseStats:
    """Counters since start, in tokens: prompt (and preempted output) tokens looked up, tokens
    restored from cached blocks, cached tokens recomputed by replay; restored tokens by the
    tier they came from (`gpu`, `local`, `shared`)."""

    num_queried_tokens: int
    num_hit_tokens: int
    num_replayed_tokens: int
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass
class _Lookup:
    """A waiting request's directory lookup: the job reads chain blocks `first ..`."""

    job: LoadJob
    first: int
    deadline: float


class PrefixReuse:
    """Match, apply and index; one instance per scheduler (it shares the manager's cache)."""

    def __init__(
        self,
        config: PrefixReuseConfig,
        kv_manager: KVCacheManager,
        store: StoreTiers | None = None,
    ) -> None:
        """store: the directory tiers under the GPU tier (None: the GPU tier only)."""
        if kv_manager.prefix_cache is None:
            raise ValueError("the KVCacheManager has no PrefixCache attached")
        if kv_manager.config.block_tokens != config.block_tokens:
            raise ValueError("PrefixReuseConfig.block_tokens differs from the manager's")
        self.config = config
        self.kv_manager = kv_manager
        self.cache: PrefixCache = kv_manager.prefix_cache
        self.store = store
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
        """Whether a waiting request may be admitted now (always, without directory tiers).

        Mutates: the first call for a request whose chain continues past the GPU tier starts
        a directory lookup (the request is then waiting for KV); it is ready once the lookup
        is done or its deadline passed. Nothing here waits on I/O."""
        rid = request.request_id
        if self.store is None or rid in self._settled:
            return True
        lookup = self._lookups.get(rid)
        if lookup is None:
            keys = self._keys(request)
            num_gpu = len(self.cache.match(keys))
            if num_gpu >= len(keys):
                self._settled.add(rid)
                return True
            blocks = self._identities(request, num_gpu, len(keys))
            job = self.store.tiers.start_load(blocks, _traffic_class(request))
            deadline = self.store.clock() + self.store.load_timeout_s
            self._lookups[rid] = _Lookup(job, num_gpu, deadline)
            return False
        if lookup.job.done.is_set() or self.store.clock() >= lookup.deadline:
            lookup.job.cancel()  # at the deadline: keep the prefix loaded so far
            self._settled.add(rid)
            return True
        return False

    def match(self, request: Request) -> CacheHit:
        """The longest cached chain of the request's tokens (prompt + outputs so far): GPU
        blocks, extended by the blocks its directory lookup loaded where they continue them.

        Mutates only the request's lazily extended `block_keys`. The hit may cover every token:
        the replay starts before P, so at least its rows are computed and the last one yields
        the logits.
        """
        keys = self._keys(request)
        blocks = self.cache.match(keys)
        loaded: list[bytes] = []
        tiers: list[str] = []
        lookup = self._lookups.get(request.request_id)
        if lookup is not None and lookup.first <= len(blocks):
            skip = len(blocks) - lookup.first  # GPU blocks that appeared meanwhile
            loaded = lookup.job.payloads()[skip:]
            tiers = lookup.job.tiers()[skip : skip + len(loaded)]
        num_cached = (len(blocks) + len(loaded)) * self.config.block_tokens
        return CacheHit(
            blocks=tuple(blocks),
            num_cached_tokens=num_cached,
            replay_start=max(0, num_cached - self.config.replay_tokens),
            loaded=tuple(loaded),
            loaded_tiers=tuple(tiers),
        )

    def apply(self, request: Request, hit: CacheHit) -> None:
        """The request was admitted holding `hit.blocks` (and fresh blocks after them): copy
        `hit.loaded` into its next blocks and index them, touch (or write back) its GPU hit
        blocks in the directory tiers, and start computing at the replay.

        Mutates the request (`num_computed_tokens` and the reuse fields), the cache and the
        counters."""
        self.release(request)
        num_gpu = len(hit.blocks)
        if hit.loaded:
            assert self.store is not None
            keys = self._keys(request)
            table = self.kv_manager.block_table(request.request_id)
            targets = table[num_gpu : num_gpu + len(hit.loaded)]
            self.store.payloads.load(targets, hit.loaded)
            for index, block in enumerate(targets, start=num_gpu):
                self.cache.insert(keys[index], block)
        request.num_reused_tokens = hit.num_cached_tokens
        request.replay_start = hit.replay_start
        request.num_computed_tokens = hit.replay_start
        request.num_indexed_blocks = num_gpu + len(hit.loaded)
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(hit.num_cached_tokens, request.num_prompt_tokens)
        self._num_queried += request.num_tokens
        self._num_hit += hit.num_cached_tokens
        self._num_replayed += hit.num_cached_tokens - hit.replay_start
        for tier in ("gpu",) * num_gpu + hit.loaded_tiers:
            self._hit_by_tier[tier] = self._hit_by_tier.get(tier, 0) + self.config.block_tokens
        if self.store is not None and num_gpu:
            self._write_back(request, 0, num_gpu, is_hit=True)

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
        """Index the request's blocks whose positions are now all computed, and queue its new
        full prompt blocks for the directory tiers.

        Mutates: new full blocks enter the cache (a block whose prefix another block already
        holds stays unindexed); `request.num_indexed_blocks` advances."""
        num_full = request.num_computed_tokens // self.config.block_tokens
        if num_full <= request.num_indexed_blocks:
            return
        keys = self._keys(request)
        block_table = self.kv_manager.block_table(request.request_id)
        first = request.num_indexed_blocks
        for index in range(first, num_full):
            self.cache.insert(keys[index], block_table[index])
        request.num_indexed_blocks = num_full
        if self.store is not None:
            self._write_back(request, first, num_full, is_hit=False)

    def forget(self, request: Request) -> None:
        """The request lost its blocks (preempted): reset what described its admission."""
        request.num_reused_tokens = request.replay_start = request.num_indexed_blocks = 0

    def release(self, request: Request) -> None:
        """The request left the waiting queue (admitted or finished): drop its directory
        lookup, if any."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is not None:
            lookup.job.cancel()
        self._settled.discard(request.request_id)

    def stats(self) -> PrefixReuseStats:
        return PrefixReuseStats(
            self._num_queried, self._num_hit, self._num_replayed, dict(self._hit_by_tier)
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
        exported = [i for i, b in enumerate(blocks) if not (is_hit and tiers.believes_present(b))]
        copies = self.store.payloads.export([table[first + i] for i in exported])
        payloads = dict(zip(exported, copies, strict=True))
        items = [WriteItem(b, payloads.get(i)) for i, b in enumerate(blocks)]
        tiers.write_back(request.request_id, items, _traffic_class(request))


def _traffic_class(request: Request) -> str:
    return request.traffic_class or CHAT
