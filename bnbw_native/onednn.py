"""The Intel spec ``BatchNormTrainingBackprop-1`` under this package's first name for it:
``bnbw_native.onednn.batch_norm_training_backprop`` is ``bnbw_native.intel_spec``'s function."""
from .intel_spec import batch_norm_training_backprop

__all__ = ["batch_norm_training_backprop"]
