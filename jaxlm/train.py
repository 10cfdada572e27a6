"""`python -m jaxlm.train --config=configs/<recipe>.py [--config.key=value ...]`

The only module that knows every part: it validates the config, builds the mesh, the data, the
sharded train state and the compiled step, then runs the loop. The loop feeds batches, reads the
previous step's metrics (never blocking on the step just dispatched), logs, evaluates and saves.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import pathlib
import sys
import time
from typing import Any, Iterator, Sequence

import jax
import ml_collections
import numpy as np

from jaxlm import config as config_lib
from jaxlm.errors import UserError

log = logging.getLogger("jaxlm")


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class Data:
    train: Iterator[dict[str, np.ndarray]]  # per-process batches of the global batch
    eval_batches: list[dict[str, np.ndarray]]
    tokenizer: Any
    train_tokens: int


def load_data(cfg: ml_collections.ConfigDict) -> Data:
    """Built-in corpus -> tokenizer (cached) -> tokens (cached) -> packed grain batches."""
    from jaxlm.data import pipeline, sources, tokenizer

    d = cfg.data
    if d.corpus != "builtin":
        raise UserError(f"config.data.corpus={d.corpus!r}: only 'builtin' is supported so far")
    docs = sources.builtin_corpus(d.builtin_max_bytes)
    train_docs, val_docs = sources.split_train_val(docs, d.val_fraction, d.seed)
    tok = tokenizer.get_or_train(d.cache_dir, train_docs, d.tokenizer_vocab_size, d.tokenizer_type)
    train_tokens = pipeline.get_or_tokenize(d.cache_dir, tok, train_docs, "train")
    val_tokens = pipeline.get_or_tokenize(d.cache_dir, tok, val_docs, "val")
    per_process = d.global_batch_size // jax.process_count()
    train_ds = pipeline.make_train_dataset(
        train_tokens,
        seq_len=d.seq_len,
        batch_size=per_process,
        seed=d.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
        num_workers=d.num_workers,
    )
    eval_batches = pipeline.make_eval_batches(
        val_tokens, seq_len=d.seq_len, batch_size=per_process, max_batches=cfg.run.eval_batches
    ) if val_tokens else []
    return Data(
        train=iter(train_ds),
        eval_batches=eval_batches,
        tokenizer=tok,
        train_tokens=int(sum(len(t) for t in train_tokens)),
    )


# ----------------------------------------------------------------------------- run directory and sinks


def make_run_dir(cfg: ml_collections.ConfigDict) -> pathlib.Path:
    name = cfg.run.name or f"{cfg.run.recipe}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    run_dir = pathlib.Path(cfg.run.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json(indent=2) + "\n")
    return run_dir


class MetricsWriter:
    """Appends one JSON object per line; only process 0 writes."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._file = open(path, "a") if jax.process_index() == 0 else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def console(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- the run


def run(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Train as the config says; returns the summary (also written to summary.json)."""
    from jaxlm import mesh as mesh_lib
    from jaxlm import optim, steps, train_state
    from jaxlm.models import attention, transformer

    config_lib.validate(cfg)
    derived = config_lib.derive(cfg, jax.device_count())
    mesh = mesh_lib.make_mesh(derived.mesh_shape)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    impl = attention.select_implementation(cfg.model.attention)
    model_cfg = transformer.ModelConfig.from_config(cfg.model, attention=impl)
    counts = transformer.param_count(model_cfg)
    run_dir = make_run_dir(cfg)
    console(f"jaxlm: run directory {run_dir}")
    console(
        f"jaxlm: {cfg.run.recipe} ({cfg.model.variant}), {counts['total'] / 1e6:.2f}M parameters, "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s), mesh data={derived.mesh_shape[0]} "
        f"fsdp={derived.mesh_shape[1]} tensor={derived.mesh_shape[2]}, attention={impl}, "
        f"batch {cfg.data.global_batch_size}x{cfg.data.seq_len} = {derived.tokens_per_step:,} tokens/step"
    )

    t0 = time.time()
    data = load_data(cfg)
    if data.tokenizer.vocab_size != model_cfg.vocab_size:
        raise UserError(
            f"the tokenizer has {data.tokenizer.vocab_size} tokens but config.model.vocab_size="
            f"{model_cfg.vocab_size}; make them equal"
        )
    console(f"jaxlm: data ready in {time.time() - t0:.1f}s ({data.train_tokens:,} training tokens)")
    data.tokenizer.save(run_dir / "tokenizer.model")

    spec = train_state.model_spec(model_cfg)
    tx, schedule = optim.make_optimizer(cfg.optim, cfg.run.steps, spec.decay_mask)
    state, shardings, spec = train_state.create(model_cfg, tx, mesh, rules, seed=cfg.run.seed)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    train_step = steps.compile_train_step(
        steps.make_train_step(
            spec,
            tx,
            schedule,
            micro_batches=cfg.optim.micro_batches,
            z_loss=cfg.optim.z_loss,
            dropout=cfg.model.dropout > 0,
            rules=rules,
        ),
        shardings,
        batch_sharding,
    )
    eval_step = steps.compile_eval_step(steps.make_eval_step(spec, rules), shardings.params, batch_sharding)

    def to_global(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in batch.items()}

    def evaluate(params) -> float | None:
        if not data.eval_batches:
            return None
        total, tokens = 0.0, 0.0
        for batch in data.eval_batches:
            loss_sum, count = eval_step(params, to_global(batch))
            total, tokens = total + float(loss_sum), tokens + float(count)
        return total / max(tokens, 1.0)

    metrics_writer = MetricsWriter(run_dir / "metrics.jsonl")
    total_steps = cfg.run.steps
    tokens_seen = 0
    start = time.time()
    step_start = start
    compile_s = None
    losses: list[float] = []
    pending = None  # (step, device metrics) of the step dispatched last
    val_loss = None
    timed_steps, timed_s = 0, 0.0

    def record(step: int, metrics) -> None:
        nonlocal tokens_seen, step_start, compile_s, timed_steps, timed_s
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.time()
        step_s = now - step_start
        step_start = now
        if compile_s is None:
            compile_s = step_s  # the first step includes compilation
        else:
            timed_steps, timed_s = timed_steps + 1, timed_s + step_s
        tokens_seen += derived.tokens_per_step
        losses.append(values["loss"])
        tokens_per_s = derived.tokens_per_step / step_s
        metrics_writer.write(
            {"step": step, **values, "tokens_seen": tokens_seen, "step_time_s": step_s,
             "tokens_per_s": tokens_per_s, "wall_s": now - start}
        )
        if step % cfg.run.log_every == 0 or step == total_steps:
            rate = derived.tokens_per_step * timed_steps / timed_s if timed_s else tokens_per_s
            eta = (total_steps - step) * (timed_s / timed_steps if timed_steps else step_s)
            console(
                f"step {step:>6}/{total_steps} | loss {values['loss']:.4f} | lr {values['lr']:.2e} | "
                f"grad norm {values['grad_norm']:.3f} | {rate:,.0f} tok/s | {step_s:.3f} s/step | ETA {_duration(eta)}"
            )
        if not math.isfinite(values["loss"]):
            raise UserError(
                f"the loss became {values['loss']} at step {step}; lower config.optim.peak_lr or raise warmup_steps"
            )

    with jax.set_mesh(mesh):
        for step in range(1, total_steps + 1):
            batch = to_global(next(data.train))
            state, metrics = train_step(state, batch)
            if pending is not None:
                record(*pending)  # the previous step: finished or nearly, so this barely waits
            pending = (step, metrics)
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < total_steps:
                record(*pending)
                pending = None
                val_loss = evaluate(state.params)
                metrics_writer.write({"step": step, "val_loss": val_loss})
                console(f"step {step:>6}/{total_steps} | val loss {val_loss:.4f}")
        if pending is not None:
            record(*pending)
        val_loss = evaluate(state.params)
        if val_loss is not None:
            metrics_writer.write({"step": total_steps, "val_loss": val_loss})

    from jaxlm import checkpoint

    ckpt_dir = checkpoint.save_final(run_dir / "checkpoints", state, cfg, tokenizer_sha256=data.tokenizer.sha256)
    metrics_writer.close()
    elapsed = time.time() - start
    summary = {
        "steps": total_steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "val_loss": val_loss,
        "tokens_seen": tokens_seen,
        "tokens_per_s": derived.tokens_per_step * timed_steps / timed_s if timed_s else None,
        "compile_s": compile_s,
        "train_s": elapsed,
        "run_dir": str(run_dir),
        "checkpoint_dir": str(ckpt_dir),
    }
    if jax.process_index() == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    val = f" (val {val_loss:.4f})" if val_loss is not None else ""
    rate = f"{summary['tokens_per_s']:,.0f} tok/s" if summary["tokens_per_s"] else "n/a tok/s"
    console(
        f"jaxlm: done: {total_steps} steps in {_duration(elapsed)}, loss {losses[0]:.4f} -> {losses[-1]:.4f}{val}, "
        f"{rate}; metrics {run_dir / 'metrics.jsonl'}, checkpoint {ckpt_dir}"
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_lib.parse_cli(argv)
        config_lib.validate(cfg)  # before any device work
        run(cfg)
    except UserError as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxlm: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
