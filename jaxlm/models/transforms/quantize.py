"""Quantized projections: the kernel stored as integer codes (`QuantizedKernel`), or a float kernel
the forward pass sees quantized (`FakeQuantizedKernel`, quantization-aware training). The formats
(codes, packing, scales, their error bounds) are `jaxlm.quant`'s."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxlm import quant as quant_lib
from jaxlm.models import layers


@dataclasses.dataclass(frozen=True)
class Quantized:
    """The model's quantized projections (`ModelConfig.quantized`): the weights named in `targets`
    (projections by attribute name, and `embed`, the token embedding) in the format `spec`, stored as
    integer codes and scales, frozen: QLoRA's base (`config.lora.quantize_base`, every block projection)
    or a compressed model (`config.compress`). With `fake`, they keep float kernels that the forward pass
    fake-quantizes (quantization-aware training)."""

    spec: quant_lib.QuantSpec
    targets: tuple[str, ...]
    fake: bool = False

    @property
    def stored(self) -> quant_lib.QuantSpec | None:
        """How the targets' kernels are stored (None: in param_dtype, as under `fake`)."""
        return None if self.fake else self.spec

    def stored_of(self, name: str) -> quant_lib.QuantSpec | None:
        """The stored format of the weights called `name`; None = float."""
        return self.stored if name in self.targets else None

    def fake_of(self, name: str) -> quant_lib.QuantSpec | None:
        """The format the weights called `name` are fake-quantized to in the forward pass (QAT)."""
        return self.spec if self.fake and name in self.targets else None

    def parts(self, name: str) -> tuple[set[type], dict[str, Any]]:
        """The projection transforms and their arguments for the projections called `name`."""
        if (spec := self.stored_of(name)) is not None:
            return {QuantizedKernel}, {"quant": spec}
        if (spec := self.fake_of(name)) is not None:
            return {FakeQuantizedKernel}, {"qat": spec}
        return set(), {}

    def describe(self) -> str:
        """What the memory plan says of them: the targets, the format, the group."""
        return (f"{', '.join(self.targets)} in {self.spec.format} (group {self.spec.group or 'per channel'}"
                f"{', double quant' if self.spec.double else ''})")


class QuantizedKernel(layers.Projection):
    """The kernel as integer codes (`jaxlm.quant`): `kernel_q` (uint8, packed along the last input axis,
    the kernel's logical names), `kernel_scale` (its groups' scales, the grouped axis unsharded),
    `kernel_zero` (asymmetric formats) and, with double quantization, `kernel_scale_absmax` and
    `kernel_scale_offset`: `layers.QuantizedParam`s, never trained. `weight()` dequantizes them inside the
    compiled step, so the device holds the integer weights. QLoRA's frozen base
    (`config.lora.quantize_base`) and a compressed model (`python -m jaxlm.compress`)."""

    def __init__(self, *args, quant: quant_lib.QuantSpec, **kwargs):
        self.quant = quant
        super().__init__(*args, **kwargs)

    def store_kernel(self, kernel: layers.nnx.Param) -> None:
        """A fresh model's random kernel, quantized (`quantized.quantize_params` does it for loaded ones)."""
        leaves = quant_lib.quantize(kernel[...], self.quant, self.quant_axis)
        names = self.kernel_names
        scale_names = tuple(None if i == self.quant_axis else n for i, n in enumerate(names))
        for key, value in leaves.items():
            leaf_names = {"q": names, "scale": scale_names, "zero": scale_names}.get(key, (None,))
            setattr(self, f"kernel_{key}", layers.QuantizedParam(value, out_sharding=leaf_names, decay=False,
                                                                 eager_sharding=False))

    @property
    def base(self) -> layers.nnx.Variable:
        return self.kernel_q

    def weight(self) -> jax.Array:
        """Dequantized from the codes and scales (in float32, then cast: the same weight as
        `quantized.dequantize_params` gives)."""
        leaves = {key: getattr(self, f"kernel_{key}")[...] for key in self.quant.keys}
        return quant_lib.dequantize(leaves, self.quant, self.quant_axis, self.dtype)

    @property
    def compute_kernel(self) -> None:
        return None

    @property
    def plain(self) -> bool:
        return False

    def cast_leaves(self) -> dict[str, object]:
        return {}


class FakeQuantizedKernel(layers.Projection):
    """A float kernel that trains, seen by the forward pass fake-quantized to `qat` (`quant.fake_quantize`:
    the integer format's weight forward, a straight-through gradient backward); `python -m jaxlm.compress`
    then writes the integer model."""

    def __init__(self, *args, qat: quant_lib.QuantSpec, **kwargs):
        self.qat = qat
        super().__init__(*args, **kwargs)

    def weight(self) -> jax.Array:
        return quant_lib.fake_quantize(self.kernel[...], self.qat, self.quant_axis).astype(self.dtype)

    @property
    def plain(self) -> bool:
        return False

    def cast_leaves(self) -> dict[str, object]:
        return {}  # fake quantization computes in float32: the kernel is not a plain cast
