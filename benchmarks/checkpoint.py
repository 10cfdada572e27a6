"""Checkpoint cost of recipes on whatever devices are here (issue 4).

    python benchmarks/checkpoint.py                            # 125m, 20 steps, a save every 5
    python benchmarks/checkpoint.py --recipes tiny 125m --json ckpt.json
    python benchmarks/checkpoint.py --recipes 125m --steps 40 --every 10 --dir /mnt/disk/tmp
    python benchmarks/checkpoint.py --set checkpoint.compress=true    # zstd-compressed arrays
    python benchmarks/checkpoint.py --snapshot off auto   # the host copy in `save`, then where it fits on the devices

With `jaxlm.checkpoint.Checkpointer` (async, as in the train loop) on the recipe's sharded train
state: how long `save` blocks the loop and how long until the files are committed (`wait`), for
the first save (one-time setup and compilation included) and a later one, with the CPU time the
later one took (all threads: the device-to-host copy, compression if on, tensorstore's writes, the
manifest's checksums, which `wait` writes); the time to write a checkpoint's manifest (sizes and
CRC-32 of every file; in training, in the background after each commit) and to verify it (what
every restore checks first); the
bytes one checkpoint takes on disk; the time to restore it onto the abstract state of a fresh `TrainSetup` (just
written, so from the page cache); and the mean train-step time over `--steps` steps with no checkpointing vs
with a save every `--every` steps, saves included, the metrics synced once at the end of each
window. The saves fall on the window's steps 1, 1+every, ...; the wait for the last one to commit,
after the window, is reported apart (`final_wait_s`). `--snapshot` runs each recipe once per
`checkpoint.snapshot` setting; `snapshot_used` says whether the saves started from a copy on the
devices (what `auto` decided). Where the checkpointed window's time goes: `save_call_s` (mean/max
of the `save` calls, the loop blocked), and Orbax's own durations of its saves there, read from
`jax.monitoring` (`orbax_*`, mean/max: waiting for the previous save, the blocking part of a save,
the commit, the removal of checkpoints retention dropped). Batches are random tokens (CPU shapes as in
train_throughput.py); no data iterator is saved. Checkpoints go to a temporary folder under `--dir`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import CPU_OVERRIDES, random_batch, report  # noqa: E402

from jaxlm import checkpoint, config, train_setup  # noqa: E402
from jaxlm.checkpoint import Checkpointer  # noqa: E402
from jaxlm.models.transformer import param_count  # noqa: E402


def cpu_s() -> float:
    """CPU seconds this process has used, all threads (Orbax's writers included)."""
    t = os.times()
    return t.user + t.system


def timed_save(ckpt: Checkpointer, step: int, state, meta: dict) -> tuple[float, float, float]:
    """(seconds `save` blocked, seconds until `wait` returned, CPU seconds used meanwhile), from the
    call to `save`; nothing else runs then, so the CPU time is the save's (copy, compression, I/O)."""
    c0, t0 = cpu_s(), time.perf_counter()
    ckpt.save(step, state, meta=meta, force=True)
    blocked = time.perf_counter() - t0
    ckpt.wait()
    return blocked, time.perf_counter() - t0, cpu_s() - c0


# Orbax's durations (jax.monitoring events) of the saves in a checkpointed window, by short name
ORBAX_EVENTS = {
    "/jax/checkpoint/write/wait_for_prev_duration_secs": "wait_prev",
    "/jax/checkpoint/write/async/blocking_duration_secs": "blocking",
    "/jax/checkpoint/write/async/commit_duration_sec": "commit",
    "/jax/checkpoint/write/remove_steps_duration_secs": "remove_steps",
}
_events: dict[str, list[float]] | None = None  # collecting while not None


def _listen(event: str, duration: float, **_) -> None:
    if _events is not None and event in ORBAX_EVENTS:
        _events.setdefault(ORBAX_EVENTS[event], []).append(duration)


jax.monitoring.register_event_duration_secs_listener(_listen)


def _mean_max(values: list[float]) -> str:
    return f"{sum(values) / len(values):.3f}/{max(values):.3f}" if values else "-"


def run_window(setup, state, batches, steps: int, ckpt: Checkpointer | None, meta: dict, first_step: int):
    """(state, mean step time, seconds of each `save` call) of `steps` steps, saving on steps 1,
    1+every, ... of the window when `ckpt`."""
    calls = []
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = setup.train_step(state, batches[i % 2], setup.expected_attention_choice())
        if ckpt is not None and i % ckpt.every_steps == 0:
            c0 = time.perf_counter()
            ckpt.save(first_step + i, state, meta=meta, force=True)
            calls.append(time.perf_counter() - c0)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - t0) / steps, calls


def bench(recipe: str, overrides: dict[str, str], steps: int, every: int, root: str) -> dict:
    cfg = config.load_recipe(recipe)
    if jax.default_backend() == "cpu":
        overrides = {**{k: str(v) for k, v in CPU_OVERRIDES.get(recipe, {}).items()}, **overrides}
    config.apply_overrides(cfg, list(overrides.items()))
    compress, snapshot, ocdbt = cfg.checkpoint.compress, cfg.checkpoint.snapshot, cfg.checkpoint.ocdbt
    setup = train_setup.build(cfg)
    target = train_setup.build(cfg, abstract=True).state  # what a resumed run restores onto
    d = cfg.data
    per_process = d.global_batch_size // jax.process_count()
    batches = [setup.put_batch(random_batch(per_process, d.seq_len, cfg.model.vocab_size, i)) for i in range(2)]
    meta = {"config": json.loads(cfg.to_json())}
    workdir = tempfile.mkdtemp(prefix=f"jaxlm-ckpt-bench-{recipe}-", dir=root)
    r = {"recipe": recipe, "overrides": overrides, "compress": compress, "snapshot": snapshot,
         "params_m": round(param_count(setup.model_cfg)["total"] / 1e6, 2),
         "batch": f"{d.global_batch_size}x{d.seq_len}", "devices": f"{jax.device_count()}x {jax.devices()[0].device_kind}"}
    try:
        with jax.set_mesh(setup.mesh), Checkpointer(os.path.join(workdir, "a"), compress=compress,
                                                                   snapshot=snapshot, ocdbt=ocdbt) as ckpt:
            r["ocdbt"] = ckpt.ocdbt  # the layout `checkpoint.ocdbt` chose
            state = jax.block_until_ready(setup.state)
            r["state_gib"] = round(sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30, 3)
            r["first_save_blocked_s"], r["first_save_total_s"], _ = timed_save(ckpt, 0, state, meta)
            # compiles the step (one document per row: the program the trainer runs for it)
            state, metrics = setup.train_step(state, batches[0], setup.expected_attention_choice())
            state = jax.block_until_ready(state)
            r["save_blocked_s"], r["save_total_s"], r["save_cpu_s"] = timed_save(ckpt, 1, state, meta)
            r["disk_gib"] = round(sum(f.stat().st_size for f in pathlib.Path(workdir, "a", "1").rglob("*")
                                      if f.is_file()) / 2**30, 3)

            step_dir = pathlib.Path(workdir, "a", "1")  # its manifest: written at `wait`, timed again alone
            t0 = time.perf_counter()
            checkpoint.write_manifest(step_dir)
            r["manifest_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert checkpoint.verify_step(step_dir)
            r["verify_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            restored, _, _ = ckpt.restore(target, step=1, verify=False)
            jax.block_until_ready(restored)
            r["restore_s"] = time.perf_counter() - t0
            del restored

            state, _, _ = run_window(setup, state, batches, 2, None, meta, 0)  # warm-up
            state, r["step_s_off"], _ = run_window(setup, state, batches, steps, None, meta, 0)
        with jax.set_mesh(setup.mesh), Checkpointer(
                os.path.join(workdir, "b"), every_steps=every, compress=compress, snapshot=snapshot,
                ocdbt=ocdbt) as ckpt:
            global _events
            _events = {}
            try:
                state, r["step_s_on"], calls = run_window(setup, state, batches, steps, ckpt, meta, 1)
                r["snapshot_used"] = ckpt.from_snapshot
                t0 = time.perf_counter()
                ckpt.wait()
                r["final_wait_s"] = time.perf_counter() - t0
                r["save_call_s"] = _mean_max(calls)
                for name in ORBAX_EVENTS.values():  # (the window's saves, the last one's after its end)
                    r[f"orbax_{name}_s"] = _mean_max(_events.get(name, []))
            finally:
                _events = None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    r["saves_in_window"] = -(-steps // every)
    r["overhead_pct"] = 100 * (r["step_s_on"] / r["step_s_off"] - 1)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["125m"])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every recipe")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
    parser.add_argument("--every", type=int, default=5, help="save every this many steps in the checkpointed window")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoints go")
    parser.add_argument("--snapshot", nargs="*", choices=("auto", "device", "host", "off"), default=[],
                        help="run each recipe with each of these checkpoint.snapshot settings (default: the config's)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.set)
    print(f"# {time.strftime('%Y-%m-%d')} | jax {jax.__version__} | orbax-checkpoint "
          f"{importlib.metadata.version('orbax-checkpoint')} | {jax.devices()[0].device_kind} x{jax.device_count()} "
          f"| python {platform.python_version()} | {platform.processor() or platform.machine()}")
    results = []
    for recipe in args.recipes:
        for snapshot in args.snapshot or [None]:
            chosen = {**overrides, "checkpoint.snapshot": snapshot} if snapshot else overrides
            result = bench(recipe, chosen, args.steps, args.every, args.dir)
            results.append(result)
            print(json.dumps(result), file=sys.stderr)
    cols = ["recipe", "compress", "ocdbt", "snapshot", "snapshot_used", "batch", "state_gib",
            "disk_gib", "first_save_blocked_s", "first_save_total_s",
            "save_blocked_s", "save_total_s", "save_cpu_s", "manifest_s", "verify_s", "restore_s", "step_s_off",
            "step_s_on", "overhead_pct", "final_wait_s", "save_call_s",
            *(f"orbax_{name}_s" for name in ORBAX_EVENTS.values())]
    report(results, cols, args.json)


if __name__ == "__main__":
    main()
