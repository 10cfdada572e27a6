"""Pruned projections: a mask beside the kernel (`kernel_mask`), zeros where weights were pruned; the
kernel holds zeros there too, and fine-tuning keeps them zero (`jaxlm.pruning_masks`)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxlm.models import layers


class MaskedKernel(layers.Projection):
    """A projection with a pruning mask: all True in a fresh model (nothing pruned yet); `jaxlm.compress`
    or gradual pruning (`jaxlm.pruning_masks`) sets it. Its forward is a plain projection's (the zeros
    are in the kernel), so it still joins others in one matmul (`layers.Joint`)."""

    def store_kernel(self, kernel) -> None:
        super().store_kernel(kernel)
        self.kernel_mask = layers.PruningMask(jnp.ones(self.kernel_shape, bool), out_sharding=self.kernel_names,
                                              decay=False, eager_sharding=False)
