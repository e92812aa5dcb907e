"""Kiln: turn pretrained LLMs into fast inference engines (PyTorch + Triton) and run them.

Load → convert → build → run:
    model = LlamaForCausalLM.from_hugging_face(dir); model.save_checkpoint(ckpt)
    engine = build(model, BuildConfig(...)); engine.save(engine_dir)
    LLM(engine_dir).generate(prompts, SamplingConfig(...))

Names are imported on first use, so `import kiln.runtime.scheduler` (plain Python) does not pull in torch.
"""
import importlib

from .version import __version__

_EXPORTS = {
    "LLM": "kiln.llm", "build": "kiln.builder", "Engine": "kiln.builder",
    "BuildConfig": "kiln.config", "ConvertConfig": "kiln.config", "KvCacheConfig": "kiln.config",
    "LoraCacheConfig": "kiln.config", "LoraConfig": "kiln.config",
    "Mapping": "kiln.config", "PluginConfig": "kiln.config", "PretrainedConfig": "kiln.config",
    "QuantConfig": "kiln.config", "SchedulerPolicy": "kiln.config", "SpeculativeConfig": "kiln.config",
    "ModelConfig": "kiln.config", "ParallelConfig": "kiln.config",
    "LoRARequest": "kiln.runtime.request",
    "SamplingConfig": "kiln.runtime.sampling", "DecodingMode": "kiln.runtime.sampling",
    "GenerationOutput": "kiln.runtime.outputs", "CompletionOutput": "kiln.runtime.outputs",
    "GenerationResult": "kiln.runtime.executor",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
