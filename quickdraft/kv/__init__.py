from quickdraft.kv.attention import AttentionBatch, prefill_chunk
from quickdraft.kv.blocks import BlockAllocator, KVPool, OutOfBlocks, SequenceKV
from quickdraft.kv.runner import ForwardItem, ModelRunner

__all__ = ["AttentionBatch", "BlockAllocator", "ForwardItem", "KVPool", "ModelRunner", "OutOfBlocks", "SequenceKV",
           "prefill_chunk"]
