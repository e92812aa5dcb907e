"""Building engines from models, and reading them back."""
from .build import build, describe_network
from .engine import Engine, engine_hash, is_engine_dir

__all__ = ["Engine", "build", "describe_network", "engine_hash", "is_engine_dir"]
