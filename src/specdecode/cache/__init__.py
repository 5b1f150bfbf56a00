from .kv import KVBatch, KVCache, KVPool

__all__ = ["KVBatch", "KVCache", "KVPool"]
