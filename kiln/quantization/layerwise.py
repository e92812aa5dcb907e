"""The float network run one decoder layer at a time over all calibration sequences (packed into one batch), so
that AWQ and GPTQ quantize each layer on the inputs the already-quantized layers before it produce.

    runner = LayerRunner(model, sequences)
    for index, layer in runner.layers():
        inputs = runner.capture(layer, ["attn.qkv_proj", ...])   # (tokens, in) input of each named linear
        ...                                                       # change the layer's weights
        runner.advance(layer)                                     # its outputs become the next layer's inputs

`forward` runs a layer outside inference mode (differentiable, on some of the sequences, with some weights
replaced): learned rounding (tune.py) trains through it.
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
        self.lengths, self.starts = lengths, [0, *torch.tensor(lengths).cumsum(0).tolist()]
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

    def stream(self) -> torch.Tensor:
        """The residual stream entering the next layer (hidden + residual: what its first RMSNorm normalises), as
        an ordinary tensor that autograd may use."""
        with torch.inference_mode(False):
            return (self.hidden if self.residual is None else self.hidden + self.residual).clone()

    def rows(self, x: torch.Tensor, sequences) -> torch.Tensor:
        """The rows of packed tensor x (one per token) that belong to `sequences` (indices), in their order."""
        return torch.cat([x[self.starts[i]:self.starts[i + 1]] for i in sequences])

    def forward(self, layer, stream: torch.Tensor, sequences=None, weights: dict | None = None) -> torch.Tensor:
        """The residual stream after `layer` for the tokens of `sequences` (default: all) of `stream`, with the
        layer's parameters named in `weights` replaced by those tensors (differentiably)."""
        sequences = range(len(self.lengths)) if sequences is None else sequences
        positions, meta = _packed_metadata([self.lengths[i] for i in sequences], stream.device)
        cache = torch.zeros((2, int(meta.block_tables.numel()), *self.cache.shape[2:]), dtype=self.cache.dtype,
                            device=self.cache.device)
        args = (self.rows(stream, sequences), None, positions, meta, cache, self.net.cos_sin)
        hidden, residual = torch.func.functional_call(layer, weights or {}, args)
        return hidden + residual
