"""The float network run one decoder layer at a time over all calibration sequences (packed into one batch), so
that AWQ and GPTQ quantize each layer on the inputs the already-quantized layers before it produce.

    runner = LayerRunner(model, sequences)
    for index, layer in runner.layers():
        inputs = runner.capture(layer, ["attn.qkv_proj", ...])   # (tokens, in) input of each named linear
        ...                                                       # change the layer's weights
        runner.advance(layer)                                     # its outputs become the next layer's inputs
"""
from __future__ import annotations

import dataclasses

import torch

from kiln.config import QuantConfig
from kiln.kernels import AttentionMetadata, ReferenceOps
from kiln.models.base import PretrainedModel

BLOCK = 16


def _packed_metadata(lengths: list[int], device) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of sequences of `lengths` packed into one prefill batch, each in its own blocks."""
    per_seq = -(-max(lengths) // BLOCK)
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.cat([b * per_seq * BLOCK + torch.arange(n) for b, n in enumerate(lengths)])
    starts = torch.tensor([0] + lengths).cumsum(0)
    tables = torch.arange(len(lengths) * per_seq).view(len(lengths), per_seq)
    meta = AttentionMetadata(slots.to(device), starts.to(device), torch.tensor(lengths, device=device),
                             tables.to(device), max(lengths), max(lengths), BLOCK)
    return positions.to(device), meta


class LayerRunner:
    """Float copy of the model's network (reference kernels); the caller may replace its layers' weights."""

    def __init__(self, model: PretrainedModel, sequences: list[list[int]]):
        if model.config.mapping.world_size > 1:
            raise ValueError("layer-by-layer calibration (AWQ, GPTQ) needs an unsharded model")
        config = dataclasses.replace(model.config, quantization=QuantConfig())
        device = next(iter(model.weights.values())).device
        lengths = [len(s) for s in sequences]
        self.net = model.network_class.load(config, model.engine_weights(), max(lengths), device, ops=ReferenceOps())
        self.positions, self.meta = _packed_metadata(lengths, device)
        blocks = int(self.meta.block_tables.numel())
        dtype = getattr(torch, config.dtype)
        self.cache = torch.zeros((2, blocks, BLOCK, config.num_key_value_heads, config.head_dim), dtype=dtype,
                                 device=device)
        ids = torch.tensor([t for s in sequences for t in s], device=device)
        with torch.inference_mode():
            self.hidden, self.residual = self.net.embed(ids), None

    def layers(self):
        return self.net.layers.items()

    @torch.inference_mode()
    def _run(self, layer):
        return layer(self.hidden, self.residual, self.positions, self.meta, self.cache, self.net.cos_sin)

    def capture(self, layer, names: list[str]) -> dict[str, torch.Tensor]:
        """The float32 inputs (tokens, in) that the layer's linear modules `names` see on this layer's inputs."""
        inputs, handles = {}, []
        for name in names:
            def hook(_module, args, name=name):
                inputs[name] = args[0].detach().float()
            handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
        try:
            self._run(layer)
        finally:
            for handle in handles:
                handle.remove()
        return inputs

    def kv_peaks(self) -> tuple[float, float]:
        """Largest |key| and |value| that the layer last run wrote to the cache."""
        return float(self.cache[0].abs().max()), float(self.cache[1].abs().max())

    def advance(self, layer) -> None:
        """Run `layer` as it now is; its outputs become the inputs of the next one."""
        self.hidden, self.residual = self._run(layer)
