"""Per-request KV/state allocation (block pool, state slots) and the prefix cache over it."""

from engine.kv_cache.manager import CacheConfig, KVCacheManager, KVCacheStats
from engine.kv_cache.prefix import PrefixCache, PrefixCacheStats

__all__ = ["CacheConfig", "KVCacheManager", "KVCacheStats", "PrefixCache", "PrefixCacheStats"]
