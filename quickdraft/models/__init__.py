from quickdraft.models.transformer import Transformer, build_model, expert_read, step_weight_bytes, weight_bytes

__all__ = ["Transformer", "build_model", "expert_read", "step_weight_bytes", "weight_bytes"]
