from quickdraft.models.transformer import Transformer, build_model

__all__ = ["Transformer", "build_model"]
