"""Fine-tuning from another run's parameters (`run.init_from`), through the real CLI: a source run
trained a few steps by `python -m jaxlm.train`, new runs started from it on another corpus and on
another mesh, their Orbax checkpoints read back. The CLI's error lines are cases of
tests/test_bad_inputs.py's catalogue; here the same errors in-process, and their values."""

import json
import logging
import math
import os
import shutil

import floats
import jax
import numpy as np
import pytest
from command_forks import run_command

import tiny_run
from helpers import xla_flags
from jaxlm import axes, checkpoint, config, inference, init_from, train_setup
from jaxlm.data.loader import DataConfig, load_data
from jaxlm.data.tokenizer import SentencePieceTokenizer
from jaxlm.errors import UserError
from jaxlm.models import transformer
from tiny_run import ROOT

RECIPE = str(ROOT / "configs" / "tiny.py")  # d_model 128, 4 layers, 2048 tokens: not the source's architecture
# The suite's fast compilation, if on, for every run here (the source and the runs from it, whose losses some
# tests compare bit for bit): runs of a few steps of a small model, their compilation most of their time.
FOUR_DEVICES = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4", fast_compile=True),
                    JAX_PLATFORMS="cpu")
EIGHT = ("--config.mesh.data=1", "--config.mesh.fsdp=-1")  # in-process: this session's 8 devices
SOURCE_MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128, vocab_size=300)  # tiny_run's


@pytest.fixture(scope="module")
def source(source_run):
    """The facts run (tests/tiny_run.py), 40 steps on one device, checkpoints at steps 20 and 40: the session's
    (tests/conftest.py), which tests/test_bad_inputs.py reads too."""
    return source_run


def finetune_args(directory, source, name, *extra, steps=8) -> list[str]:
    """A run of the tiny recipe started from `source`, on another corpus (the facts in other documents)
    and another mesh (data 2 x fsdp 2 on 4 devices), with a schedule that does not depend on run.steps."""
    return tiny_run.finetune_args(directory, source, name, *extra, steps=steps, mesh__data=2, mesh__fsdp=2,
                                  checkpoint__every_steps=4)


def train(argv) -> str:
    result = run_command("train", argv, cwd=ROOT, env=FOUR_DEVICES, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def losses(run_dir) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def finetuned(source, tmp_path_factory):
    """(its directory, the run started from `source`: 8 steps, checkpoints 4 and 8, its stdout)."""
    directory = tmp_path_factory.mktemp("finetuned")
    return directory, directory / "ft", train(finetune_args(directory, source, "ft"))


def test_a_new_run_starts_from_the_sources_parameters_on_another_corpus_and_mesh(source, finetuned):
    directory, run_dir, out = finetuned
    record = {"run_dir": str(source.resolve()), "step": 40}
    src = inference.load_run(source)  # the source's newest parameters, read by the evaluation reader
    assert src.step == 40
    count = sum(x.size for x in jax.tree.leaves(src.params))
    assert [line for line in out.splitlines() if "initialized from" in line] == [
        f"jaxlm: initialized from {source.resolve()} step 40 ({count / 1e6:.2f}M parameters)"]
    # Where it came from: in its config, every checkpoint's metadata and its summary.
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["run"]["init_from"] == str(source) and saved["run"]["init_step"] == -1
    assert saved["data"]["tokenizer_path"] == str(source / "tokenizer.model")
    assert (run_dir / "tokenizer.model").read_bytes() == (source / "tokenizer.model").read_bytes()
    with checkpoint.Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [4, 8]
        assert [ckpt.read_meta(s)["init_from"] for s in (4, 8)] == [record, record]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["init_from"] == record and summary["resumed_from"] == 0

    # The same run built here on yet another mesh (8 devices, fsdp 4 x tensor 2): its step-0 state
    # holds the source's step-40 parameters exactly, step 0 and zero Adam moments.
    cfg = init_from.config_from_cli(finetune_args(directory, source, "here", "--config.mesh.data=1", "--config.mesh.fsdp=4",
                                         "--config.mesh.tensor=2"))
    setup = train_setup.build(cfg)  # what `python -m jaxlm.train` starts a new run from
    state = setup.state
    assert setup.init_from == record and int(state.step) == 0
    assert dict(setup.mesh.shape) == axes.sizes_of(axes.shape_of(fsdp=4, tensor=2))
    mine, theirs = flat(jax.device_get(state.params)), flat(jax.device_get(src.params))
    assert mine.keys() == theirs.keys()
    floats.identical(mine, theirs, why=floats.MOVED)  # both read from the source's step-40 checkpoint
    assert jax.tree.map(lambda x: x.sharding, state.params) == setup.shardings.params
    moments = [x for x in jax.tree.leaves(jax.device_get(state.opt_state)) if np.ndim(x)]
    assert moments and not any(np.any(x) for x in moments)

    # The CLI run's step-1 loss is its first batch's loss under those parameters (another mesh, bf16
    # matmuls: not bit-equal) and far below a random init's (the source's own step 1; ln 300 = 5.7).
    data = load_data(DataConfig.from_config(cfg.data))
    with jax.set_mesh(setup.mesh):
        total, tokens = jax.device_get(setup.eval_step(state.params, setup.put_batch(next(data.train))))
    step, first = losses(run_dir)[0]
    assert step == 1 and first == pytest.approx(float(total) / float(tokens), rel=1e-2)
    random_init = json.loads((source / "summary.json").read_text())["first_loss"]
    assert random_init > 0.95 * math.log(300) and first < 0.4 * random_init


def test_the_parameters_are_cast_to_the_new_runs_param_dtype(source, tmp_path):
    import jax.numpy as jnp

    cfg = init_from.config_from_cli(finetune_args(tmp_path, source, "bf16", "--config.model.param_dtype=bfloat16",
                                         "--config.run.init_step=20", *EIGHT))
    setup = train_setup.build(cfg, abstract=True)
    state, origin = init_from.load_state(setup)
    assert origin["step"] == 20
    src = inference.load_run(source, step=20)
    mine, theirs = flat(jax.device_get(state.params)), flat(jax.device_get(src.params))
    for path, value in mine.items():
        assert value.dtype == jnp.bfloat16, path
    # Read from the same checkpoint and cast: each element rounded to the nearest bfloat16 on its own (no
    # arithmetic whose order could change), the same on any processor.
    floats.identical(mine, {path: theirs[path].astype(jnp.bfloat16) for path in mine}, why=floats.MOVED)


def test_the_architecture_and_tokenizer_come_from_the_source_and_a_contradicting_flag_is_refused(source, tmp_path):
    base = finetune_args(tmp_path, source, "arch", *EIGHT)
    cfg = init_from.config_from_cli([*base, "--config.model.dtype=float32", "--config.model.remat=full",
                            "--config.model.d_model=64"])  # a flag that repeats the source's value is fine
    config.validate(cfg)
    assert {key: cfg.model[key] for key in SOURCE_MODEL} == SOURCE_MODEL  # the recipe says 128, 4, ..., 2048
    assert cfg.data.tokenizer_vocab_size == 300 and cfg.data.tokenizer_path == str(source / "tokenizer.model")
    assert (cfg.model.dtype, cfg.model.remat, cfg.data.seq_len) == ("float32", "full", 64)  # these are the run's own
    # `python -m jaxlm.plan` plans that model.
    from jaxlm import plan

    source_model = transformer.ModelConfig.from_config(inference.read_config(source).model, "cpu")
    assert plan.plan(cfg, 8, 80 * 2**30, platform="cpu")["param_count"] == transformer.param_count(source_model)["total"]

    for flag, words in [
        ("--config.model.d_model=96", "whose model.d_model is 64"),
        ("--config.model.n_layers=4", "whose model.n_layers is 2"),
        ("--config.model.variant=gpt2", "whose model.variant is 'llama'"),
        ("--config.model.rope_theta=500000", "whose model.rope_theta is 10000.0"),
        ("--config.data.tokenizer_vocab_size=512", "whose data.tokenizer_vocab_size is 300"),  # linked to vocab_size
    ]:
        with pytest.raises(UserError) as e:
            init_from.config_from_cli([*base, flag])
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{flag} contradicts the architecture of "
                                                          f"config.run.init_from={source}")
        assert words in message and f"drop {flag.split('=')[0]}" in message, message

    # The notebook API resolves the same way.
    from jaxlm import explore

    cfg = explore.make_config("tiny", run__init_from=str(source), run__output_dir=str(tmp_path), data__seq_len=64)
    assert {key: cfg.model[key] for key in SOURCE_MODEL} == SOURCE_MODEL
    with pytest.raises(UserError, match=r"--config.model.n_heads=8 contradicts .* whose model.n_heads is 4"):
        explore.make_config("tiny", run__init_from=str(source), run__output_dir=str(tmp_path), model__n_heads=8)


def test_the_architecture_keys_follow_a_rule_not_a_list():
    """Every model key but the few that only change how it computes: keys added later (rope_*,
    *_bias, ...) come from the source without being named anywhere; max_seq_len only where the
    positions are a learned table."""
    model = config.base_config().model.to_dict()
    schema = config.base_config().model

    def architecture(m):
        return init_from.architecture(m, schema)

    keys = set(architecture(model))
    assert keys == set(model) - set(init_from.COMPUTE_MODEL_KEYS)
    assert {k for k in model if k.startswith("rope_") or k.endswith("_bias")} <= keys
    assert {"variant", "vocab_size", "d_model", "n_kv_heads", "tie_embeddings", "norm_eps", "scan_layers"} <= keys
    assert "max_seq_len" in architecture({**model, "variant": "gpt2"})
    assert "max_seq_len" in architecture({**model, "position": "learned"})
    older = {k: v for k, v in model.items() if k != "rope_theta"}  # a run from before the key existed
    assert architecture({**older, "d_model": 96}) == {**architecture(model), "d_model": 96}


def test_a_learned_position_table_keeps_the_sources_length_and_the_data_its_own(source, tmp_path):
    """With learned positions max_seq_len shapes a parameter: the model's comes from the source while
    the data's (linked to it in the recipe) stays the run's."""
    fake = tmp_path / "gpt2ish"
    shutil.copytree(source, fake)
    saved = json.loads((fake / "config.json").read_text())
    saved["model"].update(variant="gpt2", max_seq_len=128)
    (fake / "config.json").write_text(json.dumps(saved))
    cfg = init_from.config_from_cli(finetune_args(tmp_path, fake, "learned"))  # data.seq_len=64 on the command line
    config.validate(cfg)
    assert (cfg.model.variant, cfg.model.max_seq_len, cfg.data.seq_len) == ("gpt2", 128, 64)
    with pytest.raises(UserError, match=r"--config.model.max_seq_len=64 contradicts .* model.max_seq_len is 128"):
        init_from.config_from_cli([*finetune_args(tmp_path, fake, "learned"), "--config.model.max_seq_len=64"])


def test_a_fine_tune_on_short_rows_keeps_the_sources_context(source, tmp_path):
    """RoPE: the positions are no parameter, but the model's context (model.max_seq_len) is still the
    source's, whatever the rows' length (data.seq_len, linked to it in the recipe): a fine-tune on short
    rows generates and exports with the base's context. A context given on the command line (a RoPE
    extension) wins, apart from the rows' length."""
    long = tmp_path / "long"
    shutil.copytree(source, long)
    saved = json.loads((long / "config.json").read_text())
    saved["model"]["max_seq_len"] = 512
    (long / "config.json").write_text(json.dumps(saved))
    cfg = init_from.config_from_cli(finetune_args(tmp_path, long, "short"))  # data.seq_len=64 on the command line
    config.validate(cfg)
    assert (cfg.model.position or "rope", cfg.model.max_seq_len, cfg.data.seq_len) == ("rope", 512, 64)
    cfg.data.seq_len = 32  # apart: the rows' length no longer moves the model's context
    assert cfg.model.max_seq_len == 512
    extended = init_from.config_from_cli([*finetune_args(tmp_path, long, "ext"), "--config.model.max_seq_len=1024"])
    assert (extended.model.max_seq_len, extended.data.seq_len) == (1024, 64)
    with pytest.raises(UserError, match=r"config.data.seq_len=1024 is not allowed: at most model.max_seq_len=512"):
        config.validate(init_from.config_from_cli([*finetune_args(tmp_path, long, "rows"), "--config.data.seq_len=1024"]))


@pytest.mark.slow  # the recipe end to end; YaRN against transformers: tests/test_hf.py
def test_a_context_extension_continues_the_source_at_4x_its_length_with_yarn(source, tmp_path):
    """configs/long_tiny.py from the facts run (rows of 64 tokens): its parameters at step 0 are the source's,
    its RoPE settings and context (256) its own, not the source's, and a few steps at 256 tokens lower the
    held-out loss at that length from where the source, YaRN-rescaled, started."""
    long = 4 * tiny_run.SEQ_LEN
    values = {
        "run.init_from": source, "run.output_dir": tmp_path, "run.name": "long", "run.steps": 12, "run.log_every": 4,
        "run.eval_every": 0, "run.compile_cache_dir": "", "model.rope_original_max_len": tiny_run.SEQ_LEN,
        "model.max_seq_len": long, "data.seq_len": long, "data.corpus": source.parent / "facts.txt",
        "data.separator": "\n\n", "data.tokenize_on_the_fly": "true", "data.cache_dir": tmp_path / "cache",
        "data.global_batch_size": 8, "data.val_fraction": 0.2, "data.val_tokens": 4096, "optim.peak_lr": 1e-3,
        "optim.warmup_steps": 2,
    }
    argv = [f"--config={ROOT / 'configs' / 'long_tiny.py'}", *(f"--config.{k}={v}" for k, v in values.items())]
    cfg = init_from.config_from_cli([*argv, *EIGHT])
    config.validate(cfg)
    assert {key: cfg.model[key] for key in SOURCE_MODEL} == SOURCE_MODEL  # the source's architecture
    assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_original_max_len) == ("yarn", 4.0, 64)
    assert (cfg.model.max_seq_len, cfg.data.seq_len) == (long, long)
    assert json.loads((source / "config.json").read_text())["model"]["rope_scaling"] == "none"
    setup = train_setup.build(cfg)
    assert setup.model_cfg.rope_scaling == "yarn" and int(setup.state.step) == 0
    floats.identical(flat(jax.device_get(setup.state.params)), flat(jax.device_get(inference.load_run(source).params)),
                     why=floats.MOVED)

    train(argv)
    run_dir = tmp_path / "long"
    saved = json.loads((run_dir / "config.json").read_text())["model"]
    assert (saved["rope_scaling"], saved["rope_factor"], saved["rope_original_max_len"], saved["max_seq_len"]) == (
        "yarn", 4.0, 64, long)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] < summary["initial_val_loss"], summary
    assert inference.load_run(run_dir).model_cfg.rope_scaling == "yarn"  # what evaluation and generation build


@pytest.mark.slow  # ~10 s of CLI training; resuming itself is covered by tests/test_resume.py
def test_resuming_a_finetuned_run_ignores_init_from_and_continues_exactly(source, finetuned, tmp_path):
    """Stopped at step 4 and resumed to 8 with its source moved away: the same losses, bit for bit,
    as the run trained in one go (the fixture's), and no second initialization."""
    directory, expected, _ = finetuned
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    argv = finetune_args(directory, copy, "resumed")
    assert "initialized from" in train([*argv, "--config.run.steps=4"])
    copy.rename(tmp_path / "moved")  # a resumed run needs neither its source's parameters nor its tokenizer
    out = train([*argv, "--config.run.steps=8"])
    assert "resuming from step 4" in out and "initialized from" not in out
    run_dir = directory / "resumed"
    floats.identical(losses(run_dir), losses(expected), why=floats.SAME_PROGRAM)  # a resume: the same run
    assert len(losses(run_dir)) == 8
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["init_from"] == {"run_dir": str(copy.resolve()), "step": 40} and summary["resumed_from"] == 4
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["run"]["init_from"] == str(copy) and saved["model"]["d_model"] == 64
    assert saved["data"]["tokenizer_path"] == str(run_dir / "tokenizer.model")  # its own copy, the same bytes


@pytest.mark.slow
def test_frozen_parameters_stay_bit_equal_to_the_sources(source, finetuned):
    directory, _, _ = finetuned
    out = train(finetune_args(directory, source, "mlp_only", "--config.optim.trainable=mlp/", steps=3))
    assert "initialized from" in out
    tuned, src = inference.load_run(directory / "mlp_only"), inference.load_run(source)
    assert tuned.step == 3
    mine, theirs = flat(jax.device_get(tuned.params)), flat(jax.device_get(src.params))
    trained = [path for path in mine if "['mlp']" in path]
    assert trained and len(trained) < len(mine)
    for path, value in mine.items():
        if path in trained:
            assert not np.array_equal(value, theirs[path]), path
        else:  # frozen: read from the source's checkpoint, passed through every step, saved and read back
            floats.identical(value, theirs[path], why=floats.MOVED, err_msg=path)


def _damage(step_dir) -> None:
    victim = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_a_damaged_source_checkpoint_falls_back_with_a_warning_and_all_damaged_is_one_line(source, tmp_path, caplog):
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    _damage(copy / "checkpoints" / "40")
    setup = train_setup.build(init_from.config_from_cli(finetune_args(tmp_path, copy, "damaged", *EIGHT)), abstract=True)
    with caplog.at_level(logging.WARNING):
        state, origin = init_from.load_state(setup)
    assert origin == {"run_dir": str(copy.resolve()), "step": 20}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checkpoints/40 could not be restored" in warnings[0] and "trying step 20" in warnings[0]
    mine, theirs = flat(jax.device_get(state.params)), flat(jax.device_get(inference.load_run(source, step=20).params))
    floats.identical(mine, {path: theirs[path] for path in mine}, why=floats.MOVED)  # both read from step 20
    _damage(copy / "checkpoints" / "20")
    with pytest.raises(UserError) as e:
        init_from.load_state(setup)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"config.run.init_from={copy}: no checkpoint in ")
    assert "could be restored" in message and "step 40" in message and "step 20" in message, message


def test_each_bad_source_is_one_line_saying_what_to_change(source, tmp_path):
    def refused(*flags: str) -> str:
        with pytest.raises(UserError) as e:
            config.validate(init_from.config_from_cli([f"--config={RECIPE}", f"--config.run.output_dir={tmp_path}", *flags]))
        assert "\n" not in str(e.value)
        return str(e.value)

    no_config, no_checkpoint = tmp_path / "empty", tmp_path / "untrained"
    no_config.mkdir()
    (no_checkpoint / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "config.json", no_checkpoint / "config.json")
    byte_tokenizer = tmp_path / "bytes.model"
    SentencePieceTokenizer.train(["x"], 260, "byte").save(byte_tokenizer)
    cases = [
        ((f"--config.run.init_from={tmp_path / 'nope'}",), ("nope is not a directory", "give a run directory")),
        ((f"--config.run.init_from={no_config}",), ("is not a run directory (no config.json)",)),
        ((f"--config.run.init_from={no_checkpoint}",), ("has no complete checkpoint", "train it first")),
        ((f"--config.run.init_from={source}", "--config.run.init_step=30"),
         ("config.run.init_step=30", "no complete checkpoint for that step", "20, 40", "-1 for the newest")),
        ((f"--config.run.init_from={source}", f"--config.run.output_dir={source.parent}",
          f"--config.run.name={source.name}"),
         ("is this run's own directory", "config.run.name")),
        ((f"--config.run.init_from={source}", f"--config.data.tokenizer_path={byte_tokenizer}"),
         ("has 260 tokens", "vocab_size=300", "leave data.tokenizer_path empty")),
        (("--config.run.init_step=20",), ("config.run.init_step=20 is not allowed", "set run.init_from")),
        ((f"--config.run.init_from={source}", "--config.run.init_step=-2"), ("config.run.init_step=-2",)),
    ]
    for flags, words in cases:
        message = refused(*flags)
        for word in words:
            assert word in message, (flags, message)

    # A config put together by hand, without resolving run.init_from, is refused before any read.
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("run.init_from", str(source)), ("run.output_dir", str(tmp_path))])
    with pytest.raises(UserError, match=r"the config's architecture is not that run's \(model.d_model: 64 there, 128 "
                                        r"here; .*init_from.resolve_config"):
        train_setup.build(cfg)
