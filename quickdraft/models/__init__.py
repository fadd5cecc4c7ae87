from quickdraft.models.transformer import Transformer, build_model, weight_bytes

__all__ = ["Transformer", "build_model", "weight_bytes"]
