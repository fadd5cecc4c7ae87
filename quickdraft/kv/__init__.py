from quickdraft.kv.attention import AttentionBatch, prefill_chunk
from quickdraft.kv.blocks import BlockAllocator, ForwardItem, OutOfBlocks, SequenceKV
from quickdraft.kv.pool import KV_CACHE_DTYPES, KVPool, check_kv_cache_dtype, resolve_kv_cache_dtype
from quickdraft.kv.runner import STATIC_STEPS, ModelRunner

__all__ = ["AttentionBatch", "BlockAllocator", "ForwardItem", "KV_CACHE_DTYPES", "KVPool", "ModelRunner", "OutOfBlocks",
           "STATIC_STEPS",
           "SequenceKV", "check_kv_cache_dtype", "prefill_chunk", "resolve_kv_cache_dtype"]
