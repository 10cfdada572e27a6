"""`python -m jaxlm.train --config=configs/<recipe>.py [--config.key=value ...]`

The only module that knows every part: it validates the config, builds the mesh, the data, the
sharded train state and the compiled step, then runs the loop. The loop feeds batches, reads the
previous step's metrics (never blocking on the step just dispatched), logs, evaluates and saves.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import pathlib
import signal
import sys
import sysconfig
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from jaxlm import checkpoint, optim, steps, train_state
from jaxlm import config as config_lib
from jaxlm import metrics as metrics_lib
from jaxlm import mesh as mesh_lib
from jaxlm.data import pipeline, prepare, sources, tokenizer
from jaxlm.errors import UserError
from jaxlm.models import attention, transformer

# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class Data:
    train: pipeline.TrainIterator  # this process's rows of each global batch; knows its epoch
    eval_batches: list[dict[str, np.ndarray]]
    tokenizer: Any
    train_tokens: int


def source_spec(cfg: ml_collections.ConfigDict) -> sources.SourceSpec:
    d = cfg.data
    return sources.SourceSpec(d.corpus, d.format, d.text_field, d.separator, max_bytes=d.builtin_max_bytes)


def _inputs_key(cfg: ml_collections.ConfigDict) -> str:
    """A cheap identity of the corpus (its files' sizes and times, or the interpreter for the built-in
    one) and of how it is read: the cache key of its tokenizer and prepared shards."""
    spec = source_spec(cfg)
    if spec.paths == "builtin":
        files = [sys.version, sysconfig.get_paths()["stdlib"]]
    else:
        files = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in sources.resolve_files(spec)]
    identity = {"spec": dataclasses.asdict(spec), "files": files, "val_fraction": cfg.data.val_fraction,
                "seed": cfg.data.seed}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_tokenizer(cfg: ml_collections.ConfigDict, key: str) -> tokenizer.Tokenizer:
    """The configured .model file, or one trained on the corpus's training documents (cached)."""
    d = cfg.data
    if d.tokenizer_path:
        return tokenizer.Tokenizer.load(d.tokenizer_path)
    path = pathlib.Path(d.cache_dir) / f"tokenizer-{key}-{d.tokenizer_type}-{d.tokenizer_vocab_size}.model"
    if path.exists():
        return tokenizer.Tokenizer.load(path)
    console(f"jaxlm: training a {d.tokenizer_type} tokenizer ({d.tokenizer_vocab_size} tokens) on {d.corpus}")
    docs, total = [], 0
    for doc in sources.iter_documents(source_spec(cfg)):
        if not sources.is_validation(doc, d.val_fraction, d.seed):
            docs.append(doc)
            total += len(doc.encode("utf-8"))
            if total >= d.tokenizer_train_bytes:
                break
    if not docs:
        raise UserError(f"the corpus {d.corpus!r} holds no training documents; give non-empty text")
    tok = tokenizer.Tokenizer.train(docs, d.tokenizer_vocab_size, d.tokenizer_type)
    tok.save(path)
    return tok


def prepared_dir(cfg: ml_collections.ConfigDict) -> pathlib.Path:
    """The corpus as prepared shards: a prepared directory given as the corpus, or the cached one
    for these inputs and tokenizer, built on first use (resumably) with every core."""
    d = cfg.data
    given = pathlib.Path(d.corpus)
    if (given / prepare.MANIFEST).is_file():
        return given
    key = _inputs_key(cfg)
    tok = load_tokenizer(cfg, key)
    out = pathlib.Path(d.cache_dir) / f"prepared-{key}-{tok.sha256[:16]}"
    if not ((out / prepare.MANIFEST).is_file() and prepare.read_manifest(out)["complete"]):
        console(f"jaxlm: preparing {d.corpus} into {out}")
        prepare.prepare(source_spec(cfg), tok, out, val_fraction=d.val_fraction, seed=d.seed,
                        workers=os.cpu_count() or 1, progress=jax.process_index() == 0)
    return out


def load_data(cfg: ml_collections.ConfigDict) -> Data:
    """Corpus -> prepared shards (cached) -> packed grain batches, and the fixed held-out batches."""
    d = cfg.data
    directory = prepared_dir(cfg)
    tok = tokenizer.Tokenizer.load(directory / prepare.TOKENIZER)
    if d.tokenizer_path and tokenizer.Tokenizer.load(d.tokenizer_path).sha256 != tok.sha256:
        raise UserError(
            f"{directory} was prepared with another tokenizer than data.tokenizer_path={d.tokenizer_path}; "
            f"prepare it again with that tokenizer, or leave data.tokenizer_path empty"
        )
    if tok.vocab_size != cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer of {directory} has {tok.vocab_size} tokens but config.model.vocab_size="
            f"{cfg.model.vocab_size}; set config.model.vocab_size={tok.vocab_size}"
        )
    skip = d.on_damaged_shard == "skip"
    train_docs = prepare.open_prepared(directory, "train", verify=d.verify_shards, skip_damaged=skip)
    val_docs = prepare.open_prepared(directory, "val", verify=d.verify_shards, skip_damaged=skip)
    per_process = d.global_batch_size // jax.process_count()
    train_ds = pipeline.make_train_dataset(
        train_docs,
        seq_len=d.seq_len,
        batch_size=per_process,
        seed=d.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
        num_workers=d.num_workers,
    )
    eval_batches = []
    if d.val_tokens and not len(val_docs):
        console(f"jaxlm: warning: {directory} has no validation documents; raise data.val_fraction to evaluate")
    if len(val_docs) and d.val_tokens:
        max_batches = -(-d.val_tokens // (d.global_batch_size * d.seq_len))  # ceil
        eval_batches = pipeline.make_eval_batches(val_docs, seq_len=d.seq_len, batch_size=per_process,
                                                  max_batches=max_batches)
    return Data(train=iter(train_ds), eval_batches=eval_batches, tokenizer=tok, train_tokens=train_docs.num_tokens)


# ----------------------------------------------------------------------------- run directory and sinks


def run_dir_path(cfg: ml_collections.ConfigDict) -> pathlib.Path:
    """`output_dir/name`; the name defaults to the recipe's, so re-running a command resumes its run."""
    return pathlib.Path(cfg.run.output_dir) / (cfg.run.name or cfg.run.recipe)


def set_aside(run_dir: pathlib.Path) -> pathlib.Path:
    """`run.fresh`: move an existing run directory out of the way (nothing is deleted)."""
    aside = run_dir.with_name(f"{run_dir.name}-replaced-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    run_dir.rename(aside)
    return aside


# Keys that may change between a run and its resumption; any other difference is refused.
RESUMABLE_CHANGES = (
    "run.steps", "run.log_every", "run.eval_every", "run.peak_flops", "run.output_dir", "run.name", "run.fresh",
    "run.recipe", "mesh.", "model.remat", "model.attention", "data.cache_dir", "checkpoint.", "optim.on_nonfinite",
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_differences(saved: dict, cfg: ml_collections.ConfigDict) -> list[str]:
    """'key: old -> new' for every difference that matters to a resumed run."""
    old, new = _flatten(saved), _flatten(json.loads(cfg.to_json()))
    return [
        f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key) and not key.startswith(RESUMABLE_CHANGES)
    ]


def make_run_dir(run_dir: pathlib.Path, cfg: ml_collections.ConfigDict, resume_step: int) -> None:
    """Create the run directory, or ready an existing one to continue after `resume_step`: the
    metrics of later steps (lost with the process that logged them) are dropped, so none repeat."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json(indent=2) + "\n")
    jsonl = run_dir / "metrics.jsonl"
    if jsonl.exists() and jax.process_index() == 0:
        kept = [line for line in jsonl.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
        jsonl.write_text("".join(line + "\n" for line in kept))


class Sinks:
    """Where metrics go: metrics.jsonl and TensorBoard files in the run directory; only process 0 writes."""

    def __init__(self, run_dir: pathlib.Path, cfg: ml_collections.ConfigDict, resume_step: int):
        self.sinks = []
        if jax.process_index() == 0:
            tensorboard = metrics_lib.TensorBoardSink(run_dir / "tensorboard")
            if resume_step:
                tensorboard.restart(resume_step + 1)  # TensorBoard drops the lost steps' points
            else:
                tensorboard.text(0, "config", "```\n" + cfg.to_json(indent=2) + "\n```")
            self.sinks = [metrics_lib.JsonlSink(run_dir / "metrics.jsonl"), tensorboard]

    def write(self, step: int, values: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def console(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Trainer:
    """Everything a training loop needs, built from a config: the CLI, notebooks and benchmarks share it."""

    cfg: ml_collections.ConfigDict
    derived: config_lib.Derived
    model_cfg: Any  # jaxlm.models.transformer.ModelConfig
    mesh: jax.sharding.Mesh
    rules: Any
    spec: Any  # jaxlm.train_state.ModelSpec
    state: Any  # jaxlm.train_state.TrainState, sharded
    shardings: Any
    batch_sharding: jax.sharding.NamedSharding
    schedule: Any
    train_step: Any  # compiled (state, batch) -> (state, metrics); donates the state
    eval_step: Any  # compiled (params, batch) -> (sum of token losses, tokens)

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of a batch -> one global array per key, sharded over (data, fsdp)."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch as abstract arrays, for ahead-of-time compilation."""
        shape = (self.cfg.data.global_batch_size, self.cfg.data.seq_len)
        keys = ("inputs", "targets", "segment_ids", "positions")
        return {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding) for k in keys}

    def compile_train_step(self):
        """Compile the train step ahead of time (works on an abstract state): `.memory_analysis()`,
        `.cost_analysis()` and `.as_text()` of the result tell what the step will cost."""
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        with jax.set_mesh(self.mesh):
            return self.train_step.lower(state, self.batch_spec()).compile()


def build_trainer(
    cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None, *, abstract: bool = False
) -> Trainer:
    """Validate, make the mesh, create the sharded state and the steps (compiled on first call).

    With `abstract=True` the state holds only shapes and shardings (nothing is allocated), for
    `compile_train_step` on recipes larger than this machine.
    """
    config_lib.validate(cfg)
    devices = list(devices) if devices is not None else jax.devices()
    derived = config_lib.derive(cfg, len(devices))
    mesh = mesh_lib.make_mesh(derived.mesh_shape, devices)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_cfg = transformer.ModelConfig.from_config(cfg.model)
    impl = attention.select_implementation(
        cfg.model.attention, devices[0].platform, dtype=model_cfg.dtype, head_dim=model_cfg.head_dim
    )
    model_cfg = dataclasses.replace(model_cfg, attention=impl)
    spec = train_state.model_spec(model_cfg)
    tx, schedule = optim.make_optimizer(cfg.optim, cfg.run.steps, spec.decay_mask)
    if abstract:
        state, shardings, _, _ = train_state.abstract_state(model_cfg, tx, mesh, rules, cfg.run.seed, spec)
    else:
        state, shardings, _ = train_state.create(model_cfg, tx, mesh, rules, cfg.run.seed, spec)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    step_fn = steps.make_train_step(
        spec, tx, schedule, micro_batches=cfg.optim.micro_batches, z_loss=cfg.optim.z_loss,
        dropout=cfg.model.dropout > 0, rules=rules,
    )
    return Trainer(
        cfg=cfg, derived=derived, model_cfg=model_cfg, mesh=mesh, rules=rules, spec=spec, state=state,
        shardings=shardings, batch_sharding=batch_sharding, schedule=schedule,
        train_step=steps.compile_train_step(step_fn, shardings, batch_sharding),
        eval_step=steps.compile_eval_step(steps.make_eval_step(spec, rules), shardings.params, batch_sharding),
    )



class NonFiniteError(Exception):
    """A step's loss or gradient norm was not finite (its update was not applied) under policy 'stop'."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        super().__init__(
            f"step {step}: the loss ({loss}) or gradient norm ({grad_norm}) is not finite; the update was not applied. "
            f"Lower config.optim.peak_lr, raise warmup_steps or clip_norm, or set config.optim.on_nonfinite=skip"
        )
        self.step = step


class StepLog:
    """Turns each step's metrics into a JSONL record and, every `log_every` steps, a console line.

    It is handed a step's device metrics only after the next step was dispatched, so reading them
    waits for a step that is finished or nearly, never for the one just queued.
    """

    def __init__(self, sinks: Sinks, trainer: "Trainer"):
        cfg = trainer.cfg
        self.sinks, self.tokens_per_step = sinks, trainer.derived.tokens_per_step
        self.total_steps, self.log_every, self.on_nonfinite = cfg.run.steps, cfg.run.log_every, cfg.optim.on_nonfinite
        self.flops_per_token = transformer.flops_per_token(trainer.model_cfg, cfg.data.seq_len)
        self.devices = list(trainer.mesh.devices.flat)
        self.peak_flops = metrics_lib.peak_flops(self.devices[0].device_kind, cfg.run.peak_flops)
        self.skipped_steps: list[int] = []  # steps whose non-finite update was dropped
        self.start = self.last = time.time()
        self.compile_s: float | None = None  # the first step's time, which includes compilation
        self.timed_steps, self.timed_s = 0, 0.0
        self.losses: list[float] = []

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step * self.timed_steps / self.timed_s if self.timed_s else None

    def record(self, step: int, metrics: dict[str, jax.Array], data_progress: dict[str, int]) -> None:
        """`data_progress`: the data iterator's epoch and this host's real tokens after this step's batch."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()} | data_progress
        now = time.time()
        step_s, self.last = now - self.last, now
        if self.compile_s is None:
            self.compile_s = step_s
        else:
            self.timed_steps, self.timed_s = self.timed_steps + 1, self.timed_s + step_s
        self.losses.append(values["loss"])
        tokens_per_s = self.tokens_per_step / step_s
        values.update(
            tokens_seen=step * self.tokens_per_step,
            step_time_s=step_s,
            tokens_per_s=tokens_per_s,
            model_tflops_per_device=self.flops_per_token * tokens_per_s / len(self.devices) / 1e12,
            wall_s=now - self.start,
        )
        util = metrics_lib.mfu(self.flops_per_token, tokens_per_s, len(self.devices), self.peak_flops)
        if util is not None:
            values["mfu"] = util
        values.update(metrics_lib.device_memory(self.devices[0]) or {})
        self.sinks.write(step, values)
        if step % self.log_every == 0 or step == self.total_steps:
            mean_step_s = self.timed_s / self.timed_steps if self.timed_steps else step_s
            mean_rate = self.tokens_per_step / mean_step_s
            mean_mfu = metrics_lib.mfu(self.flops_per_token, mean_rate, len(self.devices), self.peak_flops)
            memory = f" | mem {values['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes" in values else ""
            console(
                f"step {step:>6}/{self.total_steps} | epoch {values['epoch']} | loss {values['loss']:.4f} | "
                f"lr {values['lr']:.2e} | "
                f"grad norm {values['grad_norm']:.3f} | {mean_rate:,.0f} tok/s | "
                f"MFU {'n/a' if mean_mfu is None else f'{100 * mean_mfu:.1f}%'}{memory} | "
                f"{mean_step_s:.3f} s/step | ETA {_duration((self.total_steps - step) * mean_step_s)}"
            )
        if values["skipped"]:
            self.skipped_steps.append(step)
            if self.on_nonfinite == "stop":
                raise NonFiniteError(step, values["loss"], values["grad_norm"])
            console(f"step {step:>6}/{self.total_steps} | skipped: loss {values['loss']}, grad norm {values['grad_norm']}")

    def pause(self) -> None:
        """Call after work outside the train step (evaluation) so it is not counted as step time."""
        self.last = time.time()


def evaluate(trainer: Trainer, params, batches: list[dict[str, np.ndarray]]) -> float | None:
    """Token-mean loss over fixed held-out batches."""
    if not batches:
        return None
    total, tokens = 0.0, 0.0
    for batch in batches:
        loss_sum, count = trainer.eval_step(params, trainer.put_batch(batch))
        total, tokens = total + float(loss_sum), tokens + float(count)
    return total / max(tokens, 1.0)


class Preempted(Exception):
    """SIGTERM or SIGINT arrived: a checkpoint was saved at a step boundary; re-run to resume."""


class StopSignals:
    """Turns SIGTERM / SIGINT into a request the loop honours at the next step boundary.

    A second SIGINT raises KeyboardInterrupt at once, for someone at a terminal who cannot wait.
    """

    def __init__(self):
        self.received: str | None = None

    def __enter__(self) -> "StopSignals":
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in self._previous:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        console(f"jaxlm: {self.received} received; saving a checkpoint at the end of this step")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Train as the config says, resuming the run directory's latest checkpoint; returns the summary."""
    run_dir = run_dir_path(cfg)
    if cfg.run.fresh and run_dir.exists():
        console(f"jaxlm: run.fresh: moved the existing {run_dir} to {set_aside(run_dir)}")
    resume_step, saved = 0, {}
    if (run_dir / "checkpoints").exists():
        with checkpoint.Checkpointer(run_dir / "checkpoints") as peek:
            for step in reversed(peek.all_steps()):  # the newest whose metadata reads; restore re-checks the rest
                try:
                    resume_step, saved = step, peek.read_meta(step)
                    break
                except Exception as e:  # a damaged checkpoint: reported, skipped, never deleted
                    console(f"jaxlm: warning: cannot read checkpoint {peek.directory / str(step)} ({e}); trying the one before")
    if saved:
        differences = config_differences(saved["config"], cfg)
        if differences:
            raise UserError(
                f"{run_dir} was trained with another config ({'; '.join(differences)}); use its values, "
                f"another config.run.name, or config.run.fresh=true to start over"
            )
    if resume_step >= cfg.run.steps:
        console(
            f"jaxlm: {run_dir} is already complete at step {resume_step}; raise config.run.steps to train on, "
            f"or set config.run.fresh=true to start over"
        )
        return json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}

    t0 = time.time()
    data = load_data(cfg)  # a bad path or corrupt file fails here, before any device work
    c = cfg.checkpoint
    with checkpoint.Checkpointer(
        run_dir / "checkpoints", every_steps=c.every_steps, every_minutes=c.every_minutes,
        keep_last=c.keep_last, keep_every=c.keep_every, async_save=c.async_save,
    ) as ckpt:
        return _train(cfg, run_dir, ckpt, data, resume_step, saved, t0)


def _train(cfg, run_dir: pathlib.Path, ckpt: checkpoint.Checkpointer, data: Data, resume_step: int, saved: dict,
           t0: float) -> dict[str, Any]:
    console(f"jaxlm: data ready in {time.time() - t0:.1f}s ({data.train_tokens:,} training tokens)")
    if saved and saved.get("tokenizer_sha256") != data.tokenizer.sha256:
        raise UserError(
            f"{run_dir} was trained with another tokenizer (sha256 {saved.get('tokenizer_sha256', '?')[:16]}, now "
            f"{data.tokenizer.sha256[:16]}); use the same data.tokenizer_* settings, or config.run.fresh=true"
        )
    trainer = build_trainer(cfg, abstract=bool(resume_step))  # a resumed state is restored, never initialised
    state = trainer.state
    if resume_step:
        state, saved, resume_step = ckpt.restore(trainer.state, data_iter=data.train)
    derived, model_cfg = trainer.derived, trainer.model_cfg
    make_run_dir(run_dir, cfg, resume_step)
    console(f"jaxlm: run directory {run_dir}" + (f", resuming from step {resume_step}" if resume_step else ""))
    console(
        f"jaxlm: {cfg.run.recipe} ({cfg.model.variant}), {transformer.param_count(model_cfg)['total'] / 1e6:.2f}M "
        f"parameters, {derived.num_devices} {trainer.mesh.devices.flat[0].platform} device(s), mesh "
        f"data={derived.mesh_shape[0]} fsdp={derived.mesh_shape[1]} tensor={derived.mesh_shape[2]}, "
        f"attention={model_cfg.attention}, batch {cfg.data.global_batch_size}x{cfg.data.seq_len} = "
        f"{derived.tokens_per_step:,} tokens/step"
    )
    data.tokenizer.save(run_dir / "tokenizer.model")

    total_steps = cfg.run.steps
    sinks = Sinks(run_dir, cfg, resume_step)
    log = StepLog(sinks, trainer)
    wall_before = saved.get("wall_s", 0.0)

    def save(step: int, force: bool = False) -> None:
        meta = {
            "config": json.loads(cfg.to_json()), "tokenizer_sha256": data.tokenizer.sha256,
            "tokens_seen": step * derived.tokens_per_step, "wall_s": wall_before + time.time() - log.start,
        }
        ckpt.save(step, state, meta=meta, data_iter=data.train, force=force)

    pending, val_loss, step = None, None, resume_step
    try:
        with jax.set_mesh(trainer.mesh), StopSignals() as signals:
            for step in range(resume_step + 1, total_steps + 1):
                state, metrics = trainer.train_step(state, trainer.put_batch(next(data.train)))
                if pending:
                    log.record(*pending)
                pending = (step, metrics, {"epoch": data.train.epoch, "host_real_tokens_seen": data.train.tokens_seen})
                if signals.received:
                    log.record(*pending)
                    save(step, force=True)
                    ckpt.wait()
                    raise Preempted(f"{signals.received} at step {step}; checkpoint {ckpt.directory / str(step)}")
                if step == total_steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
                    log.record(*pending)
                    pending = None
                    val_loss = evaluate(trainer, state.params, data.eval_batches)
                    log.pause()
                    if val_loss is not None:
                        sinks.write(step, {"val_loss": val_loss})
                        console(f"step {step:>6}/{total_steps} | val loss {val_loss:.4f}")
                if step == total_steps or ckpt.should_save(step):
                    save(step, force=True)
            ckpt.wait()
    except NonFiniteError as e:
        save(step, force=True)  # the state never took the non-finite update: it is the last good one
        ckpt.wait()
        e.checkpoint_dir = ckpt.directory / str(step)
        raise
    finally:
        sinks.close()
        if hasattr(data.train, "close"):
            data.train.close()  # stops grain's worker processes

    elapsed = time.time() - log.start
    summary = {
        "steps": total_steps,
        "resumed_from": resume_step,
        "first_loss": log.losses[0],
        "final_loss": log.losses[-1],
        "val_loss": val_loss,
        "tokens_seen": total_steps * derived.tokens_per_step,
        "tokens_per_s": log.tokens_per_s,
        "compile_s": log.compile_s,
        "skipped_steps": log.skipped_steps,
        "train_s": elapsed,
        "wall_s": wall_before + elapsed,
        "run_dir": str(run_dir),
        "checkpoint_dir": str(ckpt.directory / str(total_steps)),
    }
    if jax.process_index() == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    val = f" (val {val_loss:.4f})" if val_loss is not None else ""
    rate = f"{log.tokens_per_s:,.0f} tok/s" if log.tokens_per_s else "n/a tok/s"
    console(
        f"jaxlm: done: {total_steps} steps in {_duration(elapsed)}, loss {log.losses[0]:.4f} -> "
        f"{log.losses[-1]:.4f}{val}, {rate}; logs {run_dir} (metrics.jsonl, tensorboard/), "
        f"checkpoint {summary['checkpoint_dir']}"
    )
    return summary


def enable_compilation_cache(directory: str) -> None:
    """Keep compiled programs on disk, so a resumed or repeated run skips most compilation."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


EXIT_USER_ERROR, EXIT_NONFINITE, EXIT_PREEMPTED = 2, 3, 75  # 75: EX_TEMPFAIL, "try again": re-run resumes


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_lib.parse_cli(argv)
        config_lib.validate(cfg)  # before any device work
        config_lib.derive(cfg, jax.device_count())  # the mesh and batch fit the devices
        enable_compilation_cache(cfg.run.compile_cache_dir)
        run(cfg)
    except UserError as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except NonFiniteError as e:
        print(f"jaxlm: stopped: {e}; last good state saved in {e.checkpoint_dir}", file=sys.stderr)
        return EXIT_NONFINITE
    except Preempted as e:
        print(f"jaxlm: preempted: {e}; run the same command to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
