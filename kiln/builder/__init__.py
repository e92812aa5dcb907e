"""Building engines from models, and reading them back."""
from .build import build, build_all_ranks, build_auto_parallel, build_sharded, describe_network
from .engine import Engine, engine_hash, is_engine_dir

__all__ = ["Engine", "build", "build_all_ranks", "build_auto_parallel", "build_sharded", "describe_network", "engine_hash", "is_engine_dir"]
