"""Parameter layouts of saved checkpoints, and how a checkpoint in an older one is read.

A checkpoint's metadata records the layout its parameters were saved in (`param_layout`); one with
none predates the record and is layout 1.

  1  up to commit a89b6fe: each projection's kernel was a leaf of its layer (`blocks/attn/wq`)
  2  every weight matmul is a `layers.Projection` module: its kernel is `blocks/attn/wq/kernel`

`to_layout(tree, layout)` writes a tree of the current layout (params, or the whole train state:
Adam's moments are keyed like the params) in an older one, so that a restore target matches what
is on disk; `from_layout(tree, layout)` brings a restored tree back to the current layout.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxlm.errors import UserError

LAYOUT = 2
# Names of layout 1's projection kernels; in layout 2 each is a module holding `kernel`.
_PROJECTIONS_1 = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_in", "w_out", "unembed"})


def check(layout: int, where: str) -> None:
    """Refuse a layout this version cannot read, in one line."""
    if not 1 <= layout <= LAYOUT:
        raise UserError(f"{where} stores parameters in layout {layout}, which this jaxlm (layouts 1 to {LAYOUT}) "
                        "cannot read: it was written by a newer jaxlm; upgrade jaxlm to read it")


def to_layout(tree: Any, layout: int) -> Any:
    """`tree` (current layout) in `layout`."""
    check(layout, "the checkpoint")
    return tree if layout == LAYOUT else _map_dicts(tree, _kernels_to_leaves)


def from_layout(tree: Any, layout: int) -> Any:
    """`tree` saved in `layout`, in the current layout."""
    check(layout, "the checkpoint")
    return tree if layout == LAYOUT else _map_dicts(tree, _leaves_to_kernels)


def _map_dicts(tree: Any, fn) -> Any:
    """Apply `fn` to every outermost dict of a pytree (params, Adam's mu and nu, ...)."""
    return jax.tree.map(fn, tree, is_leaf=lambda x: isinstance(x, dict))


def _kernels_to_leaves(d: Any) -> Any:
    if not isinstance(d, dict):
        return d
    out = {}
    for key, value in d.items():
        if key in _PROJECTIONS_1 and isinstance(value, dict) and set(value) == {"kernel"}:
            out[key] = value["kernel"]
        else:
            out[key] = _kernels_to_leaves(value)
    return out


def _leaves_to_kernels(d: Any) -> Any:
    if not isinstance(d, dict):
        return d
    out = {}
    for key, value in d.items():
        if key in _PROJECTIONS_1 and not isinstance(value, dict):
            out[key] = {"kernel": value}
        else:
            out[key] = _leaves_to_kernels(value)
    return out
