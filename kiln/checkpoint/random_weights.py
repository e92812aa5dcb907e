"""Random weights of a config's checkpoint layout (benchmarks and tests): N(0, std) matrices and unit norms, each
made when it is used, on any device."""
from __future__ import annotations

import torch

from kiln.config import PretrainedConfig

from .layout import checkpoint_shapes
from .lazy import LazyWeights, TensorSpec


def random_weights(config: PretrainedConfig, seed: int = 0, device: str | torch.device = "cpu",
                   std: float = 0.02) -> LazyWeights:
    """The values one generator of `seed` gives drawing every tensor in checkpoint_shapes order, whatever order they
    are made in: the generator's state before each tensor is kept once it is known (reaching a tensor first draws
    the ones before it and drops them)."""
    shapes = checkpoint_shapes(config)
    order, dtype = list(shapes), getattr(torch, config.dtype)
    position = {name: index for index, name in enumerate(order)}
    generator = torch.Generator(device=device).manual_seed(seed)
    states = [generator.get_state()]                        # states[i]: the state before drawing order[i]

    def draw(index: int) -> torch.Tensor:
        name, shape = order[index], shapes[order[index]]
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype, device=device)
        else:
            generator.set_state(states[index])
            tensor = (torch.randn(shape, generator=generator, device=device) * std).to(dtype)
        if len(states) == index + 1:
            states.append(generator.get_state() if not name.endswith("norm.weight") else states[index])
        return tensor

    def make(names: list[str]) -> dict[str, torch.Tensor]:
        index = position[names[0]]
        while len(states) <= index:
            draw(len(states) - 1)
        return {names[0]: draw(index)}

    specs = {name: TensorSpec(tuple(shape), dtype) for name, shape in shapes.items()}
    return LazyWeights(specs, [[name] for name in order], make, "random weights", device)
