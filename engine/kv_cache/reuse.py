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
`bounded` replay of V4.1 (R = 128) truncates the windows of the first replayed rows.

Corner cases (`cache.md` §1.6): a whole prompt in cache still computes its replay rows, the last
of which yields the logits, so no block needs backing off; prompt logprobs do not exist in this
engine; a preempted request re-matches like a new one (its own blocks are usually still cached).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.hashing import KEY_BYTES, chain_seed, combine_salts, extend_chain
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.prefix import PrefixCache
from engine.outputs import PrefixRestore
from engine.request import Request


@dataclass(frozen=True)
class PrefixReuseConfig:
    """fingerprint: the namespace fingerprint (`hashing.namespace_fingerprint`), 32 bytes.
    replay_tokens: cached positions recomputed before each hit (R above; ≥ 1).
    num_history_tokens: token ids before the replay the model needs (Engram n-gram − 1).
    block_tokens: positions per block (the manager's)."""

    fingerprint: bytes
    replay_tokens: int
    num_history_tokens: int = 0
    block_tokens: int = 128

    def __post_init__(self) -> None:
        if len(self.fingerprint) != KEY_BYTES:
            raise ValueError(f"fingerprint must be {KEY_BYTES} bytes")
        if self.replay_tokens < 1 or self.num_history_tokens < 0 or self.block_tokens < 1:
            raise ValueError(
                "PrefixReuseConfig: replay_tokens >= 1, num_history_tokens >= 0, block_tokens >= 1"
            )


@dataclass(frozen=True)
class CacheHit:
    """The blocks a request reuses and where its computing restarts (both 0 on a miss)."""

    blocks: tuple[int, ...]
    num_cached_tokens: int  # P
    replay_start: int  # P − R


@dataclass(frozen=True)
class PrefixReuseStats:
    """Counters since start, in tokens: prompt (and preempted output) tokens looked up, tokens
    restored from cached blocks, cached tokens recomputed by replay."""

    num_queried_tokens: int
    num_hit_tokens: int
    num_replayed_tokens: int


class PrefixReuse:
    """Match, apply and index; one instance per scheduler (it shares the manager's cache)."""

    def __init__(self, config: PrefixReuseConfig, kv_manager: KVCacheManager) -> None:
        if kv_manager.prefix_cache is None:
            raise ValueError("the KVCacheManager has no PrefixCache attached")
        if kv_manager.config.block_tokens != config.block_tokens:
            raise ValueError("PrefixReuseConfig.block_tokens differs from the manager's")
        self.config = config
        self.kv_manager = kv_manager
        self.cache: PrefixCache = kv_manager.prefix_cache
        self._num_queried = 0
        self._num_hit = 0
        self._num_replayed = 0

    def match(self, request: Request) -> CacheHit:
        """The longest cached chain of the request's tokens (prompt + outputs so far).

        Mutates only the request's lazily extended `block_keys`. The hit may cover every token:
        the replay starts before P, so at least its rows are computed and the last one yields
        the logits.
        """
        keys = self._keys(request)
        blocks = self.cache.match(keys)
        num_cached = len(blocks) * self.config.block_tokens
        return CacheHit(
            blocks=tuple(blocks),
            num_cached_tokens=num_cached,
            replay_start=max(0, num_cached - self.config.replay_tokens),
        )

    def apply(self, request: Request, hit: CacheHit) -> None:
        """The request was admitted holding `hit.blocks`: start computing at the replay.

        Mutates the request (`num_computed_tokens` and the reuse fields) and the counters."""
        request.num_reused_tokens = hit.num_cached_tokens
        request.replay_start = hit.replay_start
        request.num_computed_tokens = hit.replay_start
        request.num_indexed_blocks = len(hit.blocks)
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(hit.num_cached_tokens, request.num_prompt_tokens)
        self._num_queried += request.num_tokens
        self._num_hit += hit.num_cached_tokens
        self._num_replayed += hit.num_cached_tokens - hit.replay_start

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
        return PrefixRestore(floor, request.num_reused_tokens, history)

    def commit(self, request: Request) -> None:
        """Index the request's blocks whose positions are now all computed.

        Mutates: new full blocks enter the cache (a block whose prefix another block already
        holds stays unindexed); `request.num_indexed_blocks` advances."""
        num_full = request.num_computed_tokens // self.config.block_tokens
        if num_full <= request.num_indexed_blocks:
            return
        keys = self._keys(request)
        block_table = self.kv_manager.block_table(request.request_id)
        for index in range(request.num_indexed_blocks, num_full):
            self.cache.insert(keys[index], block_table[index])
        request.num_indexed_blocks = num_full

    def forget(self, request: Request) -> None:
        """The request lost its blocks (preempted): reset what described its admission."""
        request.num_reused_tokens = request.replay_start = request.num_indexed_blocks = 0

    def stats(self) -> PrefixReuseStats:
        return PrefixReuseStats(self._num_queried, self._num_hit, self._num_replayed)

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
        seed = chain_seed(self.config.fingerprint, combine_salts(request.cache_salt))
        return extend_chain(
            request.block_keys, seed, request.all_token_ids, self.config.block_tokens
        )
