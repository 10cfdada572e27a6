"""`python -m jaxlm.train --config=configs/<recipe>.py [--config.key=value ...]`

Several processes (one per node or per GPU): the same command on each, joined through
`jax.distributed` from `--coordinator=host:port --num_processes=N --process_id=I
[--distributed_timeout_s=300]` or the launcher's environment (`jaxlm.distributed`).

The only module that knows every part: it validates the config, builds the mesh, the data, the
sharded train state and the compiled step, then runs the loop. The loop feeds batches, reads the
previous step's metrics (never blocking on the step just dispatched), logs, evaluates and saves.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxlm import (
    axes,
    checkpoint,
    distributed,
    energy,
    init_from,
    loss_scale,
    memory,
    objectives,
    precision,
    quant,
    train_setup,
    xla_flags,
)
from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm import metrics as metrics_lib
from jaxlm.console import Progress, console, duration
from jaxlm.data.loader import Data, rows_held
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import EXIT_TERMINATED, UserError, run_command
from jaxlm.models import transformer
from jaxlm.run_dir import (
    Sinks,
    check_run_dir,
    config_differences,
    eval_at_start,
    is_run,
    make_run_dir,
    read_json,
    run_dir_path,
    set_aside,
)
from jaxlm.run_lock import LOCK_NAME, RunLock
from jaxlm.train_setup import TrainSetup, evaluate, resolve_config


class NonFiniteError(Exception):
    """A step's loss or gradient norm was not finite (its update was not applied) under policy 'stop'."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        super().__init__(
            f"step {step}: the loss ({loss}) or gradient norm ({grad_norm}) is not finite; the update was not applied. "
            f"Lower config.optim.peak_lr, raise warmup_steps or clip_norm, or set config.optim.on_nonfinite=skip"
        )
        self.step = step
        self.checkpoint_dir: pathlib.Path | None = None  # the last good state's checkpoint, once the loop kept one
        self.kept = ""  # the line that says which checkpoint a re-run resumes from (set by the loop)


class StepLog:
    """Turns each step's metrics into a record for the sinks, the progress bar and, every
    `log_every` steps and at the run's first step (which says that training started, and how long
    the compilation it included took), a console line.

    It is handed a step's device metrics only after the next step was dispatched, so reading them
    waits for a step that is finished or nearly, never for the one just queued.
    """

    def __init__(self, sinks: Sinks, setup: TrainSetup, resume_step: int = 0, meter: energy.RunMeter | None = None):
        cfg = setup.cfg
        self.meter = meter  # the run's energy, read at the logging steps (every process: a collective)
        self.sinks, self.tokens_per_step = sinks, setup.derived.tokens_per_step
        self.objective = setup.objective  # names the step's metrics (a data mixture's by source)
        self.total_steps, self.log_every, self.on_nonfinite = cfg.run.steps, cfg.run.log_every, cfg.optim.on_nonfinite
        self.flops_per_token = transformer.flops_per_token(setup.model_cfg, cfg.data.seq_len)
        self.devices = list(setup.mesh.devices.flat)
        self.peak_flops = metrics_lib.peak_flops(self.devices[0].device_kind, cfg.run.peak_flops)
        self.progress = Progress(cfg.run.steps, resume_step, cfg.metrics.progress)
        self.skipped_steps: list[int] = []  # steps whose non-finite update was dropped
        self.overflow_steps = 0  # float16 loss scaling: steps whose scaled gradient overflowed (dropped, scale halved)
        self.attention_segments = setup.model_cfg.attention_segments
        self.warned_masked_attention = False
        self.start = self.last = time.time()
        self.compile_s: float | None = None  # the first step's time, which includes compilation
        self.timed_steps, self.timed_s = 0, 0.0
        self.timed_data_s = 0.0  # of timed_s: the loop reading batches and handing them to the devices
        # steps whose intervals the mean step time leaves out: a profiled window (`Profile.window`), and
        # steps whose intervals held the compilation of another program (`untimed_steps`)
        self.untimed: range = range(0)
        self.untimed_steps: set[int] = set()
        self.losses: list[float] = []

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step * self.timed_steps / self.timed_s if self.timed_s else None

    @property
    def mfu(self) -> float | None:
        """MFU over the timed steps (`metrics.MFU_DEFINITION`); None where the device's peak is unknown."""
        rate = self.tokens_per_s
        return None if rate is None else metrics_lib.mfu(self.flops_per_token, rate, len(self.devices), self.peak_flops)

    @property
    def data_time_fraction(self) -> float | None:
        """The share of the timed steps' time the loop spent on their batches (`data_time_s`): near 0 when the
        devices set the pace, large when the input pipeline does."""
        return self.timed_data_s / self.timed_s if self.timed_s else None

    def record(self, step: int, metrics: dict[str, jax.Array], data_progress: dict[str, float],
               histograms: dict | None = None) -> None:
        """`data_progress`: the data iterator's epoch and this host's real tokens after this step's
        batch, and the seconds the loop took for that batch (`data_time_s`); `histograms`:
        `param_histograms` of the state after this step, when due."""
        values = self.objective.scalars(metrics) | data_progress
        now = time.time()
        step_s, self.last = now - self.last, now
        first = self.compile_s is None
        if first:
            self.compile_s = step_s
        elif step not in self.untimed and step not in self.untimed_steps:
            self.timed_steps, self.timed_s = self.timed_steps + 1, self.timed_s + step_s
            self.timed_data_s += values.get("data_time_s", 0.0)
        self.losses.append(values["loss"])
        self.overflow_steps += int(values.get("overflow", 0))
        if values.get("attention_masked", 0) > 0 and not self.warned_masked_attention:
            self.warned_masked_attention = True
            self.progress.line(
                f"attention: at step {step}, rows of more than {self.attention_segments} documents sent "
                f"{100 * values['attention_masked']:.0f}% of the micro-batches to cuDNN's masked kernel (about 2x "
                f"slower than the packed layout; in one process the step with it is compiled on first use); raise "
                f"--config.model.attention_segments if this recurs (metric attention_masked)")
        tokens_per_s = self.tokens_per_step / step_s
        values.update(
            tokens_seen=step * self.tokens_per_step,
            step_time_s=step_s,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_device=tokens_per_s / len(self.devices),
            model_tflops_per_device=self.flops_per_token * tokens_per_s / len(self.devices) / 1e12,
            wall_s=now - self.start,
        )
        util = metrics_lib.mfu(self.flops_per_token, tokens_per_s, len(self.devices), self.peak_flops)
        if util is not None:
            values["mfu"] = util
        values.update(metrics_lib.device_memory(jax.local_devices()[0]) or {})
        logging_step = first or step % self.log_every == 0 or step == self.total_steps
        if self.meter is not None and logging_step:
            values.update(self.meter.interval(step, self.tokens_per_step))
        self.sinks.write(step, values)
        if histograms is not None:
            self.sinks.histograms(step, jax.device_get(histograms))
        mean_step_s = self.timed_s / self.timed_steps if self.timed_steps else step_s
        mean_rate = self.tokens_per_step / mean_step_s
        mean_mfu = metrics_lib.mfu(self.flops_per_token, mean_rate, len(self.devices), self.peak_flops)
        mfu_text = "n/a" if mean_mfu is None else f"{100 * mean_mfu:.1f}%"
        self.progress.update(step, f"loss {values['loss']:.4f} | {mean_rate:,.0f} tok/s | MFU {mfu_text}")
        if first and step % self.log_every and step != self.total_steps:  # training has started: say so at once
            self.progress.line(
                f"step {step:>6}/{self.total_steps} | epoch {values['epoch']} | loss {values['loss']:.4f} | "
                f"lr {values['lr']:.2e} | grad norm {values['grad_norm']:.3f} | first step {step_s:.1f} s, "
                f"compilation included"
            )
        elif step % self.log_every == 0 or step == self.total_steps:
            memory = f" | mem {values['peak_memory_bytes'] / 2**30:.1f} GiB" if "peak_memory_bytes" in values else ""
            if "loss_scale" in values:
                memory += f" | loss scale {values['loss_scale']:g} ({self.overflow_steps} overflow(s))"
            if "power_w" in values:
                estimated = "" if values["energy_measured"] else " est."
                memory += f" | {values['power_w']:,.0f} W{estimated}, {energy.format_energy(values['energy_j'])}"
            self.progress.line(
                f"step {step:>6}/{self.total_steps} | epoch {values['epoch']} | loss {values['loss']:.4f} | "
                f"lr {values['lr']:.2e} | grad norm {values['grad_norm']:.3f} | {mean_rate:,.0f} tok/s | "
                f"MFU {mfu_text}{memory} | {mean_step_s:.3f} s/step | "
                f"ETA {duration((self.total_steps - step) * mean_step_s)}"
            )
        if values["skipped"]:
            self.skipped_steps.append(step)
            if self.on_nonfinite == "stop":
                raise NonFiniteError(step, values["loss"], values["grad_norm"])
            self.progress.line(
                f"step {step:>6}/{self.total_steps} | skipped: loss {values['loss']}, grad norm {values['grad_norm']}"
            )

    def pause(self) -> None:
        """Call after work outside the train step (evaluation) so it is not counted as step time."""
        self.last = time.time()

    def close(self) -> None:
        self.progress.close()


class Profile:
    """`profile.steps` = "start:end": a jax.profiler trace of those steps in <run dir>/profile,
    for TensorBoard's profile plugin (xplane.pb) and for Perfetto (perfetto_trace.json.gz)."""

    def __init__(self, profile: metrics_lib.ProfileConfig, run_dir: pathlib.Path):
        self.steps, self.directory, self.active = profile.window(), run_dir / "profile", False

    @property
    def window(self) -> range:
        """The steps whose recorded intervals the trace distorts. The loop records step N's metrics after
        dispatching step N + 1, so the interval recorded for the step before the first traced one holds
        the trace's start, the traced steps' run slower, the one before the last holds writing the trace
        out (seconds) and the last's is cut short (its step had finished). The run's mean step time and
        tokens/s leave them out; metrics.jsonl keeps their intervals."""
        return range(self.steps[0] - 1, self.steps[1] + 1) if self.steps else range(0)

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        """Stops the trace after the last profiled step has finished on the devices."""
        if self.active and step == self.steps[1]:
            jax.block_until_ready(outputs)
            self.stop()
            console(f"jaxlm: profile of steps {self.steps[0]}-{self.steps[1]} written to {self.directory}")

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class Preempted(Exception):
    """SIGTERM or SIGINT arrived: a checkpoint was saved at a step boundary; re-run to resume."""


class StopSignals:
    """Turns SIGTERM / SIGINT into a request the loop honours at the next step boundary.

    A second SIGINT raises KeyboardInterrupt at once, for someone at a terminal who cannot wait.
    """

    def __init__(self):
        self.received: str | None = None

    def __enter__(self) -> StopSignals:
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
    """Train as the config says, resuming the run directory's latest checkpoint; returns the summary.

    The run holds the directory's lock (`jaxlm.run_lock`, process 0) from before it reads or moves
    anything there until it ends: a second run on the same directory stops at once, touching nothing.
    """
    run_dir = run_dir_path(cfg)
    check_run_dir(run_dir)  # a directory jaxlm did not write is refused before the lock touches it
    lock, refusal = None, ""
    if jax.process_index() == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except UserError as e:
            refusal = str(e)
    if not all(distributed.all_values(0 if refusal else 1)[:1]):
        raise UserError(refusal or f"process 0 could not lock the run directory {run_dir} (its log says why)")
    try:
        if cfg.run.fresh and jax.process_index() == 0 and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
            lock.release()
            console(f"jaxlm: run.fresh: moved the existing {run_dir} to {set_aside(run_dir)}")
            lock = RunLock(run_dir).acquire()
        return _run(cfg, run_dir)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: ml_collections.ConfigDict, run_dir: pathlib.Path) -> dict[str, Any]:
    distributed.barrier("run_dir")  # every process looks for checkpoints only after that
    resume_step, saved, verified = _newest_checkpoint(run_dir)
    if saved.get("params_only"):  # `jaxlm.hf import` or `jaxlm.compress` wrote it: no optimizer state, no data position
        raise UserError(
            f"{run_dir} holds an imported or compressed model (parameters only), not a run to continue; train from "
            f"it in a new run directory with --config.run.init_from={run_dir} (and another config.run.name)"
        )
    co = cfg.compress
    if not saved and not cfg.run.init_from and co.sparsity > 0 and co.prune_end == 0:
        raise UserError(
            f"config.compress.sparsity={co.sparsity} on a new run would prune nothing (its masks start full and "
            f"only a schedule changes them); set config.compress.prune_end (gradual pruning while training), or "
            f"start from a pruned run (python -m jaxlm.compress, then config.run.init_from)"
        )
    if saved:
        differences = config_differences(saved["config"], cfg, config_lib.base_config())
        if differences:
            raise UserError(
                f"{run_dir} was trained with another config ({'; '.join(differences)}); use its values, "
                f"another config.run.name, or config.run.fresh=true to start over"
            )
    if resume_step >= cfg.run.steps and verified:
        if jax.process_index() == 0 and not is_run(run_dir):  # config.json cut short: the checkpoint's copy
            write_bytes_atomically(run_dir / "config.json", (json.dumps(saved["config"], indent=2) + "\n").encode())
        return _already_complete(run_dir, resume_step)

    t0 = time.time()
    # a bad path or corrupt file fails here, before any device work
    data = objectives.from_config(cfg).load_data(cfg, saved.get("data_shards"), _process_rows(cfg))
    section = checkpoint.CheckpointConfig.from_config(cfg.checkpoint)
    with checkpoint.Checkpointer.from_config(run_dir / "checkpoints", section) as ckpt:
        return _train(cfg, run_dir, ckpt, data, resume_step, saved, t0)


def _newest_checkpoint(run_dir: pathlib.Path) -> tuple[int, dict, bool]:
    """(step, metadata, verified) of the newest checkpoint that matches its manifest, chosen by
    process 0, which alone reads the files through; (0, {}, False) when there is none. `verified`
    is False for one without a manifest: restoring it is the check."""
    directory = run_dir / "checkpoints"
    steps = checkpoint.complete_steps(directory)
    seen = distributed.all_values(len(steps))
    if len(set(seen)) > 1:
        raise UserError(
            f"the processes see different checkpoints in {directory} ({seen} complete); put "
            f"config.run.output_dir on a filesystem every process shares"
        )
    if not steps:
        return 0, {}, False
    newest, verified, every_one_damaged = steps[-1], False, ""
    if jax.process_index() == 0:  # reads every file of the newest checkpoints through: once, here
        def check(s: int) -> bool:
            return checkpoint.verify_step(directory / str(s))  # True, False without a manifest; raises when damaged

        try:
            verified, newest = checkpoint.newest_loadable(directory, steps, None, check, verify=False)
        except UserError as e:
            newest, every_one_damaged = -1, str(e)
    newest, verified = distributed.all_values(newest)[0], bool(distributed.all_values(int(verified))[0])
    if newest < 0:
        raise UserError(
            (every_one_damaged or f"every checkpoint in {directory} is damaged (process 0 says which)")
            + "; restore them from a copy, or set config.run.fresh=true to start over (this run is moved aside)"
        )
    with checkpoint.Checkpointer(directory) as peek:  # (Orbax's reads synchronise the processes)
        candidates = [s for s in steps if s <= newest]
        saved, resume_step = checkpoint.newest_loadable(directory, candidates, None, peek.read_meta, verify=False)
    return resume_step, saved, verified and resume_step == newest


def _already_complete(run_dir: pathlib.Path, step: int) -> dict[str, Any]:
    console(
        f"jaxlm: {run_dir} is already complete at step {step}; raise config.run.steps to train on, "
        f"or set config.run.fresh=true to start over"
    )
    return read_json(run_dir / "summary.json") if (run_dir / "summary.json").exists() else {}


def _set_aside_damaged(ckpt: checkpoint.Checkpointer, run_dir: pathlib.Path, resume_step: int) -> None:
    """Checkpoints newer than the one resumed did not verify or restore: move them into
    `<run dir>/damaged_checkpoints` (never deleted), so that their steps can be trained and saved again."""
    damaged = [s for s in ckpt.all_steps() if s > resume_step]
    if damaged and jax.process_index() == 0:
        moved = ckpt.set_aside(damaged, run_dir / "damaged_checkpoints")
        console(f"jaxlm: warning: damaged checkpoint(s) moved to {', '.join(map(str, moved))}; "
                f"training again from step {resume_step}")
    distributed.barrier("damaged_checkpoints")
    if damaged:
        ckpt.reload()


def _train(cfg, run_dir: pathlib.Path, ckpt: checkpoint.Checkpointer, data: Data, resume_step: int, saved: dict,
           t0: float) -> dict[str, Any]:
    size = (f"{data.train_tokens:,} training tokens" if data.train_tokens is not None
            else f"{data.train_documents:,} training documents, tokenized on the fly")
    console(f"jaxlm: data ready in {time.time() - t0:.1f}s ({size})")
    if data.mixture is not None and resume_step < cfg.run.steps:
        tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
        console(f"jaxlm: {data.mixture.report(resume_step + 1, cfg.run.steps, tokens_per_step)}")
    if saved and saved.get("tokenizer_sha256") != data.tokenizer.sha256:
        raise UserError(
            f"{run_dir} was trained with another tokenizer (sha256 {saved.get('tokenizer_sha256', '?')[:16]}, now "
            f"{data.tokenizer.sha256[:16]}); use the same data.tokenizer_* settings, or config.run.fresh=true"
        )
    meter = energy.RunMeter(energy.EnergyConfig.from_config(cfg.energy), jax.local_devices(), jax.device_count(),
                            before_j=saved.get("energy_j", 0.0), before_device_s=saved.get("device_s", 0.0))
    try:
        return _train_metered(cfg, run_dir, ckpt, data, resume_step, saved, meter)
    finally:
        meter.close()


def _train_metered(cfg, run_dir: pathlib.Path, ckpt: checkpoint.Checkpointer, data: Data, resume_step: int,
                   saved: dict, meter: energy.RunMeter) -> dict[str, Any]:
    # A resumed state is restored, never initialised; a new one with run.init_from holds that run's parameters.
    build_cfg, dtype_line = _compute_dtype(cfg, saved)
    setup = train_setup.build(build_cfg, abstract=bool(resume_step))
    _check_process_rows(setup, data)
    state, origin = setup.state, setup.init_from  # origin: {"run_dir", "step"} its step-0 parameters came from
    if resume_step:
        _set_aside_damaged(ckpt, run_dir, resume_step)  # those that did not match their manifests
        # (process 0 checked the manifests already, in _newest_checkpoint)
        # an on-policy objective's batches are a function of the state and the step: no stream position
        data_iter = None if setup.objective.on_policy else data.train
        state, saved, resume_step = ckpt.restore(setup.state, data_iter=data_iter, verify=False)
        _set_aside_damaged(ckpt, run_dir, resume_step)  # one without a manifest that did not restore
        meter.rebase(saved.get("energy_j", 0.0), saved.get("device_s", 0.0))  # the checkpoint restored
        if resume_step >= cfg.run.steps:  # it had no manifest: restoring it was the check
            ckpt.record_manifest(resume_step)
            return _already_complete(run_dir, resume_step)
        origin = saved.get("init_from")
    derived, model_cfg = setup.derived, setup.model_cfg
    make_run_dir(run_dir, cfg, resume_step)
    console(f"jaxlm: run directory {run_dir}" + (f", resuming from step {resume_step}" if resume_step else ""))
    setup.objective.prepare(setup, state, data, run_dir, resume_step)  # its frozen inputs (DPO: the reference's)
    params_total = transformer.param_count(model_cfg)["total"]
    params_trained = trainable_count(setup, state.params)
    params_active = transformer.active_param_count(model_cfg)
    console(
        f"jaxlm: {cfg.run.recipe} ({cfg.model.variant}), {params_total / 1e6:.2f}M parameters"
        + ("" if params_active == params_total else f" ({params_active / 1e6:.2f}M active per token)")
        + ("" if params_trained == params_total else
           f" ({format_count(params_trained)} trainable, {100 * params_trained / params_total:.2f}%)")
        + f", {derived.num_devices} {setup.mesh.devices.flat[0].platform} device(s), mesh "
        f"{axes.describe(derived.mesh_shape)}, "
        f"attention={model_cfg.attention}"
        + (f" (packed layout, up to {model_cfg.attention_segments} documents per row)"
           if model_cfg.attention_segments else "")
        + f", batch {cfg.data.global_batch_size}x{cfg.data.seq_len} = "
        f"{derived.tokens_per_step:,} tokens/step"
        + (f" in {setup.cfg.optim.micro_batches} micro-batches of {derived.per_device_batch} sequence(s) per device"
           + (" (optim.micro_batches=0: as few as fit)" if not cfg.optim.micro_batches else "")
           if setup.cfg.optim.micro_batches > 1 or not cfg.optim.micro_batches else "")
    )
    for line in config_lib.inert_settings(cfg, derived):
        console(f"jaxlm: warning: {line}")
    console(f"jaxlm: {dtype_line}")
    console(f"jaxlm: {meter.line}")
    device = setup.mesh.devices.flat[0]
    remaining = (cfg.run.steps - resume_step) * derived.tokens_per_step
    predicted = energy.predict(transformer.flops_per_token(model_cfg, cfg.data.seq_len) * remaining,
                               derived.num_devices, device.device_kind, device.platform,
                               metrics_lib.peak_flops(device.device_kind, cfg.run.peak_flops), cfg.energy)
    if predicted:
        console(f"jaxlm: predicted: {energy.format_prediction(predicted, f'{cfg.run.steps - resume_step:,} steps')}")
    if setup.init_from:
        bits = setup.model_cfg.stored_quant.bits if setup.model_cfg.stored_quant else 4
        console(f"jaxlm: {init_from.describe(setup.init_from, state.params, bits)}")
    if jax.process_index() == 0:
        data.tokenizer.save(run_dir / data.tokenizer.file_name)
    if jax.process_count() > 1:
        console(f"jaxlm: {jax.process_count()} processes, {jax.local_device_count()} devices each; "
                f"{data.shards} data shard(s), each process reads {len(data.train.streams)}")

    total_steps = cfg.run.steps
    sinks = Sinks(run_dir, cfg, resume_step)
    log = StepLog(sinks, setup, resume_step, meter)
    profile = Profile(metrics_lib.ProfileConfig.from_config(cfg.profile), run_dir)
    log.untimed = profile.window
    histograms_every = cfg.metrics.histograms_every
    wall_before = saved.get("wall_s", 0.0)

    def save(step: int, force: bool = False, val_loss: float | None = None) -> None:
        meta = {
            "config": json.loads(cfg.to_json()), "tokenizer_sha256": data.tokenizer.sha256,
            "tokens_seen": step * derived.tokens_per_step, "wall_s": wall_before + time.time() - log.start,
            "data_shards": data.shards, "process_count": jax.process_count(),
            "compute_dtype": jnp.dtype(model_cfg.dtype).name,  # what model.dtype=auto chose: a resume keeps it
            # the run's energy up to this step (a collective, like the save): a resumed run counts on from it
            "energy_j": meter.run_joules(), "device_s": meter.device_seconds(),
        }
        if origin:
            meta["init_from"] = origin
        if initial_val_loss is not None:
            meta["initial_val_loss"] = initial_val_loss  # (a resumed run's summary still has it)
        sinks.flush()  # the metrics of every step this checkpoint covers are on disk before it is
        ckpt.save(step, state, meta=meta, data_iter=None if on_policy else data.train, force=force, val_loss=val_loss)

    eval_target_bytes = data.eval_target_bytes
    # An on-policy objective (GRPO) makes each batch from the current state (`Objective.next_batch`), and
    # saves only where a checkpoint resumes exactly (`checkpoint_allowed`: rollout boundaries)
    on_policy = setup.objective.on_policy

    pending, val_loss, step, initial_val_loss = None, None, resume_step, saved.get("initial_val_loss")
    kernels: set[bool | None] = set()  # the `packed` arguments of the steps compiled so far
    # Every process acts on a signal, or on process 0's clock saying a save is due, at the same step.
    agreement = distributed.StepAgreement()
    try:
        with jax.set_mesh(setup.mesh), StopSignals() as signals:
            if not resume_step and eval_at_start(cfg.run):  # the baseline: the held-out loss before any step
                val = evaluate(setup, setup.eval_params(state), data.eval_batches, eval_target_bytes)
                log.pause()
                if val:
                    initial_val_loss = val["val_loss"]
                    sinks.write(0, val)
                    log.progress.line(f"step {0:>6}/{total_steps} | {setup.objective.describe_eval(val)} "
                                      f"(before the first step)")
            for step in range(resume_step + 1, total_steps + 1):
                profile.before(step)
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    data_start = time.perf_counter()
                    if on_policy:  # each row one sequence from slot 0: the packed layout fits when there is one
                        batch, host_metrics = setup.objective.next_batch(setup, state, data, step)
                        packed = setup.expected_attention_choice()
                    else:
                        host_batch = next(data.train)
                        packed = setup.attention_choice(host_batch)  # cuDNN's kernel for this batch, or None
                        batch = setup.put_batch(host_batch)
                    data_time_s = time.perf_counter() - data_start
                    if packed not in kernels and kernels:
                        # This step compiles its program first (the other attention kernel): the interval
                        # that holds the compilation, the next one recorded, is not timed.
                        log.untimed_steps.add(pending[0] if pending else step)
                    kernels.add(packed)
                    step_start = time.perf_counter()
                    state, metrics = setup.train_step(state, batch, packed, *setup.frozen_args())
                    if on_policy:  # the next rollout waits for this step anyway: time it, read its sums
                        host_metrics.update(setup.objective.step_metrics(metrics))
                        host_metrics["training_s"] = time.perf_counter() - step_start
                        spent = host_metrics["sampling_s"] + host_metrics["training_s"]
                        host_metrics["sampling_share"] = host_metrics["sampling_s"] / spent if spent else 0.0
                profile.after(step, metrics)
                if pending:
                    log.record(*pending)
                # data_time_s: this host's seconds to read the step's batch and hand it to the devices, which
                # the loop waits for (the devices may still be busy with the step before)
                progress = {"epoch": data.train.epoch, "host_real_tokens_seen": data.train.tokens_seen,
                            "data_time_s": data_time_s, **(host_metrics if on_policy else {})}
                boundary = setup.objective.checkpoint_allowed(step)
                histograms = None
                if histograms_every and step % histograms_every == 0:
                    histograms = metrics_lib.param_histograms(state.params)
                    if setup.mesh.devices.flat[0].platform == "cpu":
                        # Finished before the next step starts: two programs with collectives in flight
                        # at once can deadlock XLA:CPU's device threads (seen with 8 fake devices).
                        jax.block_until_ready(histograms)
                pending = (step, metrics, progress, histograms)
                if signals.received:
                    agreement.propose("stop", step)
                if boundary and agreement.due("stop", step):
                    log.record(*pending)
                    save(step, force=True)
                    ckpt.wait()
                    why = signals.received or "a stop signal to another process"
                    raise Preempted(f"{why} at step {step}; checkpoint {ckpt.directory / str(step)}")
                evaluated = None
                if step == total_steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
                    log.record(*pending)
                    pending = None
                    val = evaluate(setup, setup.eval_params(state), data.eval_batches, eval_target_bytes)
                    log.pause()
                    if val:
                        val_loss = val["val_loss"]
                        sinks.write(step, val)
                        log.progress.line(f"step {step:>6}/{total_steps} | {setup.objective.describe_eval(val)}")
                        evaluated = val_loss
                # With keep_best, every evaluated step is saved: a candidate for the best checkpoints.
                if ckpt.time_due():
                    agreement.propose("save", step)
                due = boundary and (ckpt.step_due(step) or agreement.due("save", step))
                if step == total_steps or due or (evaluated is not None and cfg.checkpoint.keep_best and boundary):
                    if pending:  # this step's metrics go to disk with the checkpoint (the save waits for it anyway)
                        log.record(*pending)
                        pending = None
                    save(step, force=True, val_loss=evaluated)
            ckpt.wait()
    except NonFiniteError as e:
        boundary = setup.objective.checkpoint_allowed(step)
        if boundary:
            save(step, force=True)  # the state never took the non-finite update: it is the last good one
        ckpt.wait()
        last = ckpt.latest_step()
        e.checkpoint_dir = None if last is None else ckpt.directory / str(last)
        if boundary:
            e.kept = f"last good state saved in {e.checkpoint_dir}"
        else:  # inside a rollout (GRPO, mu > 1): no checkpoint resumes exactly here; the last one stands
            e.kept = (f"no checkpoint saved at step {step}, inside a rollout (checkpoints fall on rollout boundaries); "
                      + (f"the last is {e.checkpoint_dir}: a re-run resumes from it and does steps {last + 1}-{step} "
                         f"again" if last is not None else f"none was saved before: a re-run starts again from step 0"
                         f" and does steps 1-{step} again"))
        raise
    finally:
        profile.stop()
        log.close()
        sinks.close()
        if hasattr(data.train, "close"):
            data.train.close()  # stops grain's worker processes

    elapsed = time.time() - log.start
    summary = {
        "steps": total_steps,
        "resumed_from": resume_step,
        "init_from": origin,  # where the parameters at step 0 came from (run.init_from), or None
        "params": params_total,
        "trainable_params": params_trained,  # (what the optimizer updates: LoRA's adapters, optim.trainable)
        "active_params": params_active,  # (what a token goes through: an MoE's routed experts, not all)
        "initial_val_loss": initial_val_loss,  # before the first step (run.eval_at_start), or None
        "first_loss": log.losses[0],
        "final_loss": log.losses[-1],
        "val_loss": val_loss,
        "tokens_seen": total_steps * derived.tokens_per_step,
        "tokens_per_s": log.tokens_per_s,  # over the timed steps (the first, compiling, left out)
        "tokens_per_s_per_device": log.tokens_per_s / len(log.devices) if log.tokens_per_s else None,
        "model_flops_per_token": log.flops_per_token,
        "peak_flops_per_device": log.peak_flops,  # None: a device kind whose peak jaxlm does not know
        "mfu": log.mfu,  # over the timed steps; None where the peak is unknown (a CPU, unless run.peak_flops)
        "mfu_definition": metrics_lib.MFU_DEFINITION,
        "data_time_fraction": log.data_time_fraction,
        "compile_s": log.compile_s,
        "skipped_steps": log.skipped_steps,
        "overflow_steps": log.overflow_steps,  # float16 loss scaling's skipped overflows (0 without scaling)
        "train_s": elapsed,
        "wall_s": wall_before + elapsed,
        "run_dir": str(run_dir),
        "checkpoint_dir": str(ckpt.directory / str(total_steps)),
    }
    if meter.active:
        meter.run_joules()
        summary.update(meter.totals(), energy_source=meter.source)
    if jax.process_index() == 0:
        write_bytes_atomically(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    val = f" (val {val_loss:.4f})" if val_loss is not None else ""
    rate = f"{log.tokens_per_s:,.0f} tok/s" if log.tokens_per_s else "n/a tok/s"
    if log.mfu is not None:
        rate += f", MFU {100 * log.mfu:.1f}% (causal attention counted half, of the bf16 peak)"
    console(
        f"jaxlm: done: {total_steps} steps in {duration(elapsed)}, loss {log.losses[0]:.4f} -> "
        f"{log.losses[-1]:.4f}{val}, {rate}{'; ' + meter.describe_totals() if meter.active else ''}; "
        f"logs {run_dir} (metrics.jsonl, tensorboard/), "
        f"checkpoint {summary['checkpoint_dir']}"
    )
    return summary


def trainable_count(setup: TrainSetup, params) -> int:
    """The weights the optimizer updates (`ModelSpec.split`'s trainable part; arrays or shapes)."""
    bits = setup.model_cfg.stored_quant.bits if setup.model_cfg.stored_quant else 4
    return quant.count(setup.model_spec.split(params)[0], bits)


def format_count(n: int) -> str:
    """12,345 -> "12.3K": a parameter count as the start-of-run line shows it."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit != 'K' else 1}f}{unit}"
    return str(n)


def _compute_dtype(cfg: ml_collections.ConfigDict, saved: dict) -> tuple[ml_collections.ConfigDict, str]:
    """(the config to build the run with, a line saying its compute dtype). `model.dtype=auto` resolves for
    this machine's devices (`jaxlm.precision`), except in a resumed run, which keeps the dtype its
    checkpoint was trained in (a float16 run carries a loss scale in its state)."""
    device = jax.local_devices()[0]
    if cfg.model.dtype != "auto":
        scaled = " with dynamic loss scaling" if loss_scale.enabled(cfg.optim.loss_scale, cfg.model.dtype) else ""
        return cfg, f"compute {cfg.model.dtype}{scaled} (model.dtype)"
    chosen, why = precision.auto_dtype(device.platform, precision.compute_capability(device))
    earlier = saved.get("config", {}).get("model", {}).get("dtype")  # a run from before auto existed
    kept = saved.get("compute_dtype") or (earlier if earlier not in (None, "auto") else None)
    if kept and kept != chosen:
        return (memory.with_overrides(cfg, {"model.dtype": kept}),
                f"compute {kept} (model.dtype=auto: kept from this run's checkpoints; here auto would choose {chosen})")
    return memory.with_overrides(cfg, {"model.dtype": chosen}), f"compute {chosen} (model.dtype=auto: {why})"


def _process_rows(cfg: ml_collections.ConfigDict) -> slice | None:
    """The rows of each global batch this process's devices hold under the run's mesh (one contiguous
    block per process, the same block for processes that differ only along axes the batch is replicated
    over); None in a single process, which reads every row."""
    if jax.process_count() == 1:
        return None
    devices = jax.devices()
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(cfg, len(devices)), devices, hybrid=cfg.mesh.hybrid)
    sharding = mesh_lib.batch_sharding(mesh, mesh_lib.rules_from_config(cfg.mesh.rules))
    return rows_held(sharding, (cfg.data.global_batch_size, cfg.data.seq_len))


def _check_process_rows(setup: TrainSetup, data: Data) -> None:
    """The rows this process reads must be the rows its devices hold in the global batch."""
    if jax.process_count() == 1:
        return
    held = rows_held(setup.batch_sharding, (setup.cfg.data.global_batch_size, setup.cfg.data.seq_len))
    if held != data.train.rows:
        raise UserError(
            f"process {jax.process_index()}'s devices hold batch rows {held.start}:{held.stop} of the global batch, "
            f"not the block {data.train.rows.start}:{data.train.rows.stop} it reads; order config.mesh so that each "
            f"process's devices are contiguous along the batch axes, mesh.rules.act_batch (e.g. mesh.hybrid)"
        )


def enable_compilation_cache(directory: str) -> None:
    """Keep compiled programs on disk, so a resumed or repeated run skips most compilation."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# user errors: errors.EXIT_USER_ERROR (2); 75: EX_TEMPFAIL, "try again": re-run resumes
EXIT_NONFINITE, EXIT_PREEMPTED = 3, EXIT_TERMINATED


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command(lambda: _main(argv), resume="every complete checkpoint is kept: run the same command to resume")


def _main(argv: list[str]) -> int:
    """Exit codes: errors.run_command's (2 a user error, 74 the environment, 75 SIGTERM and 130
    Ctrl-C before the loop), 3 a non-finite step, 75 stopped by a signal in the loop after a save."""
    try:
        argv, layout_flags = distributed.pop_flags(list(argv))
        cfg = init_from.config_from_cli(argv)
        config_lib.validate(cfg)  # before any device work
        config_lib.check_paths(cfg)  # and what it will write
        if cfg.run.xla_flags:
            console(f"jaxlm: XLA_FLAGS={xla_flags.apply(cfg.run.xla_flags)}")  # before JAX starts, checked
        xla_flags.apply_libtpu(cfg.run.libtpu_flags)  # before libtpu loads (read on a TPU only), checked
        joined = distributed.join(**layout_flags)  # a multi-process run: join it first
        if joined:
            console(f"jaxlm: {joined}")
        resolved = resolve_config(cfg, jax.devices())
        config_lib.derive(resolved, jax.device_count())  # the mesh and batch fit the devices
        memory.check_fits(resolved, jax.devices())  # and the memory, before anything is allocated
        enable_compilation_cache(cfg.run.compile_cache_dir)
        run(cfg)
    except NonFiniteError as e:
        print(f"jaxlm: stopped: {e}; {e.kept}", file=sys.stderr)
        return EXIT_NONFINITE
    except Preempted as e:
        print(f"jaxlm: preempted: {e}; run the same command to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
