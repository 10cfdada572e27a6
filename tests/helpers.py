"""Small shared builders for the tests."""

import importlib.util
import math
import os
import pathlib
import re
import sys

import jax.numpy as jnp
import numpy as np

from jaxlm.models.transformer import ModelConfig

_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*\w+\[([\d,]*)\]")


def hlo_dot_flops(hlo: str) -> int:
    """2 * output elements * contracted size, summed over every dot of an (optimized) HLO module."""
    shapes, total = {}, 0
    for line in hlo.splitlines():
        if m := _DEFINITION.match(line):
            shapes[m.group(1)] = [int(d) for d in m.group(2).split(",") if d]
    for line in hlo.splitlines():
        if " dot(" not in line or not (m := _DEFINITION.match(line)):
            continue
        lhs = re.search(r"dot\(%([^,\s)]+)", line).group(1)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
        k = math.prod(shapes[lhs][int(d)] for d in contracting.split(",") if d)
        total += 2 * math.prod(shapes[m.group(1)]) * k
    return total


# The code generation flags tests/conftest.py adds under JAXLM_TEST_FAST_COMPILE=1
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def xla_flags(*flags: str, fast_compile: bool = False) -> str:
    """XLA_FLAGS for a test's subprocess: the flags the suite was given (`--xla_cpu_max_isa` under `make test-isa`:
    tests/conftest.py keeps them), conftest's SUITE_FLAGS and `flags`; not the 8 fake devices conftest adds.
    `fast_compile`: also the unoptimized code generation where this suite runs with it (conftest's FAST_COMPILE),
    for a run of a few steps, where compiling the optimized code would cost more than running the slower code
    saves."""
    ours = os.environ.get("XLA_FLAGS", "").split()
    suite = [f for f in ours if f.startswith("--xla_cpu_parallel_codegen_split_count=")]  # conftest's SUITE_FLAGS
    fast = [f for f in FAST_COMPILE_FLAGS if fast_compile and f in ours]
    return " ".join([*suite, os.environ.get("JAXLM_TEST_XLA_FLAGS_GIVEN", ""), *fast, *flags]).strip()


def small_config(**overrides) -> ModelConfig:
    """A model small enough to compile in a second or two, with grouped-query heads."""
    fields = dict(
        vocab_size=96, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=8, mlp_dim=128,
        max_seq_len=32, dtype=jnp.float32, param_dtype=jnp.float32,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def train_tiny(directory, name: str, *overrides: tuple[str, str]) -> dict:
    """Train the tiny recipe in this process as `python -m jaxlm.train` would, into `directory`/`name`
    (its data cache beside it), with config overrides; returns the run's summary."""
    from jaxlm import config, train

    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("run.output_dir", str(directory)), ("run.name", name),
                                 ("data.cache_dir", str(pathlib.Path(directory) / "cache")), *overrides])
    return train.run(cfg)


def step_losses(overrides: dict, steps: int = 3, devices: int = 8) -> list[float]:
    """The tiny recipe with `overrides` (`a__b=value`) built on the first `devices` devices: the losses of
    `steps` train steps on the random batches `random_batch(16, 32, 128, seed=step)`."""
    import jax

    from jaxlm import config, train_setup

    setup = train_setup.build(config.recipe("tiny", **overrides), jax.devices()[:devices])
    state, losses = setup.state, []
    with jax.set_mesh(setup.mesh):
        for i in range(steps):
            state, metrics = setup.train_step(state, setup.put_batch(random_batch(16, 32, 128, seed=i)))
            losses.append(float(metrics["loss"]))
    return losses


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0, packed: bool = True) -> dict[str, np.ndarray]:
    """Random tokens; with `packed`, each row holds two documents and a little padding."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(4, vocab, (batch, seq)).astype(np.int32)
    targets = rng.integers(4, vocab, (batch, seq)).astype(np.int32)
    if packed:
        first = seq // 2 + 3
        pad = 2
        seg = np.array([1] * first + [2] * (seq - first - pad) + [0] * pad, np.int32)
        pos = np.array(list(range(first)) + list(range(seq - first - pad)) + [0] * pad, np.int32)
    else:
        seg = np.ones(seq, np.int32)
        pos = np.arange(seq, dtype=np.int32)
    targets = np.where(seg[None] > 0, targets, 0).astype(np.int32)
    return {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": np.repeat(seg[None], batch, 0),
        "positions": np.repeat(pos[None], batch, 0),
        "weights": np.repeat((seg[None] > 0).astype(np.float32), batch, 0),
    }


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module, leaving sys.path as it was: a script's folder left first on
    sys.path shadows packages for every later test (a benchmarks/multiprocess.py once hid the
    `multiprocess` package that `datasets` imports, and its test was skipped)."""
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_benchmarks_{name}", path)
    module, saved = importlib.util.module_from_spec(spec), list(sys.path)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def llama_layout_model(**special_ids: int) -> bytes:
    """A SentencePiece model trained by sentencepiece itself, not by jaxlm, with Llama's special ids
    (unk 0, bos 1, eos 2, no pad) unless others are given, and byte fallback: 300 ids."""
    import io

    import sentencepiece as spm

    ids = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1, **special_ids}
    lines = ["alice likes apples. bob likes bananas.", "def f(x):", "    return x + 1"] * 20
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buffer, model_type="bpe",
                                   vocab_size=300, byte_fallback=True, num_threads=1, minloglevel=2, **ids)
    return buffer.getvalue()
