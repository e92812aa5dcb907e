"""Configuration dataclasses: what a model is, how it is converted and built. All validation lives here."""
from .build import LORA_TARGET_MODULES, AutoParallelConfig, BuildConfig, LoraConfig, PluginConfig
from .convert import ConvertConfig
from .fields import field_docs
from .mapping import Mapping
from .model import ModelConfig
from .parallel import ParallelConfig
from .pretrained import PretrainedConfig
from .quant import QuantConfig, excluded_modules
from .runtime import KvCacheConfig, LoraCacheConfig, SchedulerPolicy, SpeculativeConfig
from .yaml_file import BuildFile, ModelSection, load_build_file

__all__ = ["LORA_TARGET_MODULES", "AutoParallelConfig", "BuildConfig", "BuildFile", "ConvertConfig", "KvCacheConfig",
           "LoraCacheConfig", "LoraConfig", "Mapping", "ModelConfig", "ModelSection", "ParallelConfig", "PluginConfig",
           "PretrainedConfig", "QuantConfig", "SchedulerPolicy", "SpeculativeConfig", "excluded_modules", "field_docs",
           "load_build_file"]
