"""The package's layers (README.md's Layout): every module is placed in one, and imports point down or
across, never up. A new module must be placed in `LAYERS`; an import that points up fails here."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxlm"

# The top-level modules and packages of jaxlm, by layer (higher imports lower)
LAYERS = {
    4: {"train", "evaluate", "generate", "hf", "compress", "plan", "doctor", "experiment", "explore", "commands",
        "config_reference", "lm_eval"},  # commands
    # training and planning; config assembles the typed sections their owners define (`jaxlm.section`)
    3: {"config", "train_setup", "steps", "optim", "pruning_masks", "train_state", "checkpoint", "init_from",
        "lora", "metrics", "run_dir", "run_lock", "energy", "inference", "memory", "roofline", "hlo",
        "post_training", "objectives", "sampling", "scoring"},
    2: {"models", "data", "quant", "loss_scale", "precision"},  # models and data
    1: {"section", "axes", "mesh", "errors", "console", "table", "distributed", "xla_flags", "cli", "paths",
        "overrides", "lazy"},  # basics
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


LOCAL_IMPORT = "# local import:"


def _unexplained_local_imports(path: pathlib.Path) -> list[str]:
    """The imports inside a function in `path` that say nowhere why they are not at the top: a
    `# local import: <why>` comment on the import's line(s), on the line above, or above a run of
    such imports directly before it (optional or heavy dependencies, private JAX APIs, start-up time)."""
    lines = path.read_text().splitlines()
    local: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                local.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse("\n".join(lines)), False)
    ends = {node.end_lineno: node for node in local}
    explained: dict[int, bool] = {}
    for node in sorted(local, key=lambda n: n.lineno):
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        explained[node.lineno] = (
            any(LOCAL_IMPORT in line for line in lines[node.lineno - 1:node.end_lineno])
            or (above.startswith("#") and LOCAL_IMPORT in above)
            or (node.lineno - 1 in ends and explained[ends[node.lineno - 1].lineno])
        )
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
            for node in local if not explained[node.lineno]]


def test_every_local_import_says_why():
    """An import inside a function that merely dodges an import cycle hides a layering problem: imports
    go at the top, and the few that cannot (`# local import: ...`) say why."""
    unexplained = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _unexplained_local_imports(path)]
    assert not unexplained, "\n".join(["move these to the top, or say why not (# local import: ...):", *unexplained])
