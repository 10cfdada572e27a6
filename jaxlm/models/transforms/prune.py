"""Pruned projections: a mask beside the kernel (`kernel_mask`), zeros where weights were pruned; the
kernel holds zeros there too, and fine-tuning keeps them zero (`jaxlm.pruning_masks`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxlm.models import layers


@dataclasses.dataclass(frozen=True)
class Pruned:
    """The model's pruned projections (`ModelConfig.pruned`, from `config.compress.sparsity`): each target
    holds a mask beside its kernel; the step keeps the pruned weights zero (`jaxlm.pruning_masks`)."""

    targets: tuple[str, ...]

    def parts(self, name: str) -> tuple[set[type], dict[str, Any]]:
        """The projection transforms (`MaskedKernel`) and their arguments for the projections called `name`."""
        return ({MaskedKernel}, {}) if name in self.targets else (set(), {})


class MaskedKernel(layers.Projection):
    """A projection with a pruning mask: all True in a fresh model (nothing pruned yet); `jaxlm.compress`
    or gradual pruning (`jaxlm.pruning_masks`) sets it. Its forward is a plain projection's (the zeros
    are in the kernel), so it still joins others in one matmul (`layers.Joint`)."""

    def store_kernel(self, kernel) -> None:
        super().store_kernel(kernel)
        self.kernel_mask = layers.PruningMask(jnp.ones(self.kernel_shape, bool), out_sharding=self.kernel_names,
                                              decay=False, eager_sharding=False)
