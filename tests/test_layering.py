"""The package's layers (README.md's Layout): every module is placed in one, and imports point down or
across, never up. A new module must be placed in `LAYERS`; an import that points up fails here."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxlm"

# The top-level modules and packages of jaxlm, by layer (higher imports lower)
LAYERS = {
    4: {"train", "evaluate", "generate", "hf", "compress", "plan", "doctor", "experiment", "explore",
        "config_reference"},  # commands
    # training and planning; config assembles the typed sections their owners define (`jaxlm.section`)
    3: {"config", "train_setup", "steps", "optim", "pruning_masks", "train_state", "checkpoint", "init_from",
        "lora", "metrics", "run_dir", "run_lock", "energy", "inference", "memory", "roofline", "hlo"},
    2: {"models", "data", "quant", "loss_scale", "precision"},  # models and data
    1: {"section", "axes", "mesh", "errors", "console", "table", "distributed", "xla_flags"},  # basics
}
LAYER = {name: layer for layer, names in LAYERS.items() for name in names}

# Imports that still point up, to be removed (issue 46): none left.
KNOWN_UP: set[tuple[str, str]] = set()


def _modules() -> dict[str, list[pathlib.Path]]:
    out: dict[str, list[pathlib.Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] != "__init__":
            out.setdefault(parts[0], []).append(path)
    return out


def _imported(path: pathlib.Path) -> set[str]:
    """The top-level jaxlm modules `path` imports (anywhere in the file, function-local imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "jaxlm":
                out |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("jaxlm.")}
    return out


def test_every_module_is_placed_in_a_layer():
    assert set(_modules()) <= set(LAYER), sorted(set(_modules()) - set(LAYER))


def test_no_module_imports_one_above_it():
    up = set()
    for name, paths in _modules().items():
        for path in paths if name in LAYER else ():  # an unplaced module fails the test above
            up |= {(name, other) for other in _imported(path) if other in LAYER and LAYER[other] > LAYER[name]}
    assert up <= KNOWN_UP, sorted(up - KNOWN_UP)
    assert KNOWN_UP <= up, f"no longer imported, drop from KNOWN_UP: {sorted(KNOWN_UP - up)}"
