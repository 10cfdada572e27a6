"""Model transforms: what a feature does to a projection, each in its own module.

`layers.Projection` is a plain kernel: `einsum(equation, x, kernel)` in the compute dtype. A feature
that changes how a projection stores or computes its weight, or adds to its output, is a subclass of
it here, a mixin that keeps the parameters' names (so checkpoints read the same whatever the code):

- `quantize.QuantizedKernel`: the kernel stored as integer codes and scales (`kernel_q`, ...),
  dequantized in the step (QLoRA's frozen base, a compressed model).
- `quantize.FakeQuantizedKernel`: a float kernel the forward pass fake-quantizes (QAT).
- `prune.MaskedKernel`: a pruning mask (`kernel_mask`) beside the kernel.
- `lora.Adapted`: LoRA adapters (`lora_a`, `lora_b`) added to the output.

`projection_class` composes the ones a projection takes into one class (cached, so a model's
structure is the same object from build to build); `transformer.ModelConfig.projection` picks them
from the model's settings for each projection by name.
"""

from __future__ import annotations

import functools

from jaxlm.models import layers
from jaxlm.models.transforms.lora import Adapted
from jaxlm.models.transforms.prune import MaskedKernel
from jaxlm.models.transforms.quantize import FakeQuantizedKernel, QuantizedKernel

# Every transform of a projection, in the order they compose (the first one's methods run first)
PROJECTION_TRANSFORMS = (Adapted, MaskedKernel, FakeQuantizedKernel, QuantizedKernel)


@functools.cache
def projection_class(parts: frozenset[type]) -> type[layers.Projection]:
    """The Projection class with the transforms `parts` (a set of `PROJECTION_TRANSFORMS`), composed."""
    if not parts:
        return layers.Projection
    unknown = parts - set(PROJECTION_TRANSFORMS)
    if unknown:
        raise ValueError(f"not projection transforms: {sorted(t.__name__ for t in unknown)}")
    bases = tuple(t for t in PROJECTION_TRANSFORMS if t in parts)
    if len(bases) == 1:
        return bases[0]
    return type("".join(t.__name__ for t in bases) + "Projection", bases, {"__module__": __name__})
