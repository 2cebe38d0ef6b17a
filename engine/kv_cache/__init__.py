"""Per-request KV/state allocation: block pool for global KV, slots for per-sequence state."""

from engine.kv_cache.manager import CacheConfig, KVCacheManager, KVCacheStats

__all__ = ["CacheConfig", "KVCacheManager", "KVCacheStats"]
