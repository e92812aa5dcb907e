"""Kernels. `reference` (pure torch) is the CPU path and the oracle; fast kernels plug in here, chosen once."""
from . import reference as ops
from .metadata import AttentionMetadata
from .rotary import rope_cos_sin, rope_inv_freq

__all__ = ["AttentionMetadata", "ops", "rope_cos_sin", "rope_inv_freq"]
