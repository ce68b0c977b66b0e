from .intel_spec import batch_norm_training_backprop as batch_norm_training_backprop

__all__ = ["batch_norm_training_backprop"]
