from quickdraft.kv.paged import AttentionBatch, BlockAllocator, KVPool, OutOfBlocks, SequenceKV
from quickdraft.kv.runner import ForwardItem, ModelRunner

__all__ = ["AttentionBatch", "BlockAllocator", "ForwardItem", "KVPool", "ModelRunner", "OutOfBlocks", "SequenceKV"]
