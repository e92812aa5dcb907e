"""LoRA adapters made with `peft` for the tests of this directory: random A and B, large enough to change the greedy
tokens, saved in Hugging Face PEFT's format."""
from __future__ import annotations

import torch


def make_adapter(hf_dir, out_dir, targets, seed: int = 0, r: int = 8, alpha: int | None = None, std: float = 0.2,
                 safetensors: bool = True, **options):
    """A PEFT adapter (lora_alpha 2r unless given) on the transformers model of hf_dir, saved to out_dir; returns
    the transformers + peft model that runs it."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    config = LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=targets, **options)
    return randomized(get_peft_model(base, config), out_dir, seed, std, safetensors)


def randomized(model, out_dir, seed: int, std: float, safetensors: bool = True):
    """The peft model with every lora_A/lora_B weight drawn from N(0, std²), saved to out_dir (safetensors, or
    adapter_model.bin), in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir, safe_serialization=safetensors)
    return model.eval()
