from quickdraft.kv.paged import AttentionBatch, BlockAllocator, KVPool, OutOfBlocks, SequenceKV, prefill_chunk
from quickdraft.kv.runner import ForwardItem, ModelRunner

__all__ = ["AttentionBatch", "BlockAllocator", "ForwardItem", "KVPool", "ModelRunner", "OutOfBlocks", "SequenceKV",
           "prefill_chunk"]
