"""A real training run, seconds long, on a corpus of made-up facts ("alice likes apples."), for the
evaluation and generation tests: trained by the CLI, `python -m jaxlm.train` (forked from a process that
imported it, tests/command_forks.py), on one CPU device (the tests then load it onto their 8), so its run
directory is exactly what users get."""

import os
import pathlib
import random

from command_forks import run_command

from helpers import xla_flags

NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
FRUITS = ("apples", "bananas", "cherries", "dates", "figs", "grapes", "lemons", "mangos")
LIKES = dict(zip(NAMES, FRUITS))  # the facts the model learns: alice likes apples, ...
STEPS = 120
SEQ_LEN = 64
ROOT = pathlib.Path(__file__).resolve().parent.parent


def write_corpus(path: pathlib.Path, documents: int = 400, seed: int = 0) -> list[str]:
    """Documents of 3 to 6 facts in random order, separated by blank lines; returns them."""
    rng = random.Random(seed)
    docs = [" ".join(f"{n} likes {LIKES[n]}." for n in rng.sample(NAMES, rng.randint(3, 6))) for _ in range(documents)]
    path.write_text("\n\n".join(docs))
    return docs


def train_args(directory: pathlib.Path, steps: int = STEPS) -> list[str]:
    """The `python -m jaxlm.train` arguments of the facts run in `directory` (its corpus written there)."""
    corpus = directory / "facts.txt"
    if not corpus.exists():
        write_corpus(corpus)
    overrides = dict(
        model__vocab_size=300, model__d_model=64, model__n_layers=2, model__n_heads=4, model__n_kv_heads=2,
        model__mlp_dim=128, data__seq_len=SEQ_LEN, data__global_batch_size=16, data__corpus=corpus,
        model__dtype="bfloat16",  # on every CPU (auto: float32 on those without bfloat16 instructions)
        data__separator="\n\n", data__val_fraction=0.2, data__cache_dir=directory / "cache",
        data__tokenize_on_the_fly="true",  # no prepare step (its worker processes take seconds to start)
        optim__warmup_steps=10, run__steps=steps, run__eval_every=0, run__log_every=steps,
        run__output_dir=directory, run__name="facts", run__compile_cache_dir="",
    )
    return ["--config=configs/tiny.py", *(f"--config.{key.replace('__', '.')}={value}" for key, value in overrides.items())]


ONE_DEVICE = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1"), JAX_PLATFORMS="cpu")


def train_tiny_run(directory: pathlib.Path, steps: int = STEPS, extra: tuple[str, ...] = (),
                   fast_compile: bool = False) -> pathlib.Path:
    """Train a 2-layer model on the facts corpus (`directory/facts.txt`); returns the run directory.
    `extra`: more `--config.key=value` flags; `fast_compile`: the suite's fast compilation where it has it
    (`helpers.xla_flags`), for a run of a few steps."""
    env = dict(ONE_DEVICE, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1", fast_compile=fast_compile))
    result = run_command("train", [*train_args(directory, steps), *extra], cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "facts"


def finetune_args(directory: pathlib.Path, source, name: str, *extra: str, steps: int = 8, **flags) -> list[str]:
    """The `python -m jaxlm.train` arguments of a tiny-recipe run started from `source`
    (`run.init_from`), on the facts in other documents (`directory/other.txt`) tokenized on the fly,
    at a constant learning rate; `flags` (`section__key=value`) add or replace config keys, `extra`
    comes last."""
    corpus = directory / "other.txt"
    if not corpus.exists():
        write_corpus(corpus, documents=300, seed=7)
    values = {
        "run.init_from": source, "run.output_dir": directory, "run.name": name, "run.steps": steps, "run.log_every": 1,
        "run.eval_every": 0, "run.compile_cache_dir": "", "data.corpus": corpus, "data.separator": "\n\n",
        "data.tokenize_on_the_fly": "true", "data.cache_dir": directory / "cache", "data.seq_len": 64,
        "data.global_batch_size": 16, "data.val_fraction": 0.2, "data.val_tokens": 1024, "optim.schedule": "constant",
        "optim.warmup_steps": 0, "optim.peak_lr": 1e-3,
    }
    values.update({key.replace("__", "."): value for key, value in flags.items()})
    return [f"--config={ROOT / 'configs' / 'tiny.py'}", *(f"--config.{k}={v}" for k, v in values.items()), *extra]


def train_chat_run(directory: pathlib.Path, source: pathlib.Path, steps: int = 40) -> pathlib.Path:
    """A chat run: the facts run `source` fine-tuned on the built-in chat set with the simple template
    (data.format=chat, its tokenizer), its RoPE context extended from the source's 64 to 256 positions
    so that a two-turn conversation fits (rows of 256 too); returns its directory. About 15 s on 2 CPU
    cores; its answers are in the format, not right."""
    args = finetune_args(directory, source, "chat", steps=steps, data__corpus="builtin_chat", data__format="chat",
                         data__chat_template="simple", data__seq_len=256, model__max_seq_len=256,
                         data__global_batch_size=8,
                         data__val_fraction=0, optim__peak_lr=3e-3)
    result = run_command("train", args, cwd=ROOT, env=ONE_DEVICE, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "chat"
