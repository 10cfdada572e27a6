"""`python -m jaxlm.compress`: a trained run -> a compressed run directory, with what it cost.

    python -m jaxlm.compress --run_dir=RUN --output=DIR [--step=N] [--corpus=val|FILES] [--tasks=a.jsonl,b.jsonl]
        --config.compress.quantize=int4 [--config.compress.method=gptq] [--config.compress.group=128] ...
        --config.compress.sparsity=0.5 [--config.compress.criterion=wanda] [--config.compress.pattern=2:4] ...

The output is a run directory like any other (config.json with the compress section, the tokenizer,
checkpoint <step> holding the compressed parameters): `jaxlm.evaluate`, `jaxlm.generate`,
`jaxlm.explore` and `jaxlm.hf export` (dequantized) read it; `jaxlm.train --config.run.init_from=DIR`
fine-tunes it (masks kept, a quantized base under LoRA adapters). Its `compress_report.json` and
`compress_report.md` hold the report, also printed: bytes on disk and on the device, parameters and
non-zeros, loss, perplexity and bits per byte before and after on `--corpus` (default the run's
validation split), multiple-choice accuracy on `--tasks`, generation tokens per second before and
after on this machine, and the compression time. A QAT run (`compress.qat`) is written in its integer
format (round to nearest, the quantizer it trained with).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm import checkpoint, commands, evaluate, generate, inference, quant, train_state
from jaxlm import config as config_lib
from jaxlm import run_dir as run_dir_lib
from jaxlm.compress import calibrate, methods
from jaxlm.console import command_logging
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError, run_command

log = logging.getLogger("jaxlm.compress")

PROMPT = "The"


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _params_bytes(params) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(params)))


def _float_cfg(model_cfg):
    """The source's model as float kernels (a QAT run's fake quantization off)."""
    return dataclasses.replace(model_cfg, quantized=None)


def _resolve(run: inference.LoadedRun, overrides: Sequence[tuple[str, Any]]):
    """The output's config: the run's, with the command line's compress keys (a QAT run: its own format,
    now written for real)."""
    cfg = run.cfg.copy_and_resolve_references()
    if run.model_cfg.stored_quant is not None or run.model_cfg.pruned is not None:
        raise UserError(f"{run.run_dir} is compressed already (compress.quantize={cfg.compress.quantize!r}, "
                        f"compress.sparsity={cfg.compress.sparsity}); compress the run it came from")
    if run.model_cfg.lora is not None:
        raise UserError(f"{run.run_dir} has LoRA adapters (lora.rank={cfg.lora.rank}); merge them first "
                        f"(python -m jaxlm.hf export --adapters=merge, then import), and compress the merged run")
    bad = [key for key, _ in overrides if not key.startswith("compress.")]
    if bad:
        raise UserError(f"--config.{bad[0]}: python -m jaxlm.compress takes compress.* keys only; the model and "
                        f"the rest are the run's")
    qat = bool(cfg.compress.qat)
    config_lib.apply_overrides(cfg, overrides)
    with cfg.unlocked():
        cfg.compress.qat = False
    if qat and not any(key == "compress.method" for key, _ in overrides):
        cfg.compress.method = "rtn"
    config_lib.validate(cfg)
    if not cfg.compress.quantize and cfg.compress.sparsity <= 0:
        raise UserError("nothing to compress: give --config.compress.quantize=int8|int4|int3|nf4 and/or "
                        "--config.compress.sparsity=<fraction>")
    return cfg


def _calibration(run: inference.LoadedRun, cfg, imported: bool) -> np.ndarray:
    """The calibration sequences [N, T]: compress.calib_samples windows of calib_seq_len tokens."""
    co = cfg.compress
    seq_len = min(int(co.calib_seq_len), run.model_cfg.max_seq_len)
    want = int(co.calib_samples) * seq_len
    if co.calib_corpus:
        docs, _ = evaluate.corpus_documents(run, co.calib_corpus, split="train", max_tokens=want, format="text")
    elif imported:
        raise UserError(f"{run.run_dir} was imported and has no training corpus of its own to calibrate "
                        f"{'GPTQ' if co.method == 'gptq' and co.quantize else 'Wanda'} on; give "
                        f"--config.compress.calib_corpus=<text files or a prepared directory>")
    else:
        docs = evaluate.training_documents(run, want)
    tokens = calibrate.sequences([np.asarray(d[0] if isinstance(d, tuple) else d) for d in docs], co.calib_samples,
                                 seq_len)
    if not len(tokens):
        raise UserError(f"the calibration corpus has fewer than {seq_len} tokens; give a larger "
                        f"--config.compress.calib_corpus (or a smaller compress.calib_seq_len)")
    shards = run.batch_shards
    return tokens[: max(shards, len(tokens) // shards * shards)] if len(tokens) >= shards else np.resize(
        tokens, (shards, seq_len))


def _variant(run: inference.LoadedRun, cfg, model_cfg, params) -> inference.LoadedRun:
    """`run` with another model and parameters (placed on its mesh when they fit it, else a mesh they fit)."""
    rules = run.rules
    spec = train_state.build_model_spec(model_cfg)
    try:
        abstract, *_ = train_state.abstract_state(model_cfg, optax.identity(), run.mesh, rules, 0, spec)
        mesh, abstract_params = run.mesh, abstract.params
    except UserError:
        mesh, abstract_params = inference.make_inference_mesh(cfg, model_cfg, spec, list(run.mesh.devices.flat), rules)
    shardings = jax.tree.map(lambda x: x.sharding, abstract_params)
    params = jax.device_put(params, shardings)
    return dataclasses.replace(run, cfg=cfg, model_cfg=model_cfg, model_spec=spec, mesh=mesh, params=params,
                               param_shardings=shardings)


def _target_bytes(params: dict, names: Sequence[str]) -> int:
    """Bytes of the projections called `names` (every leaf of their modules: kernels, codes, scales, masks)."""
    total = 0
    for key, value in params.items():
        if isinstance(value, dict):
            total += _params_bytes(value) if key in names else _target_bytes(value, names)
    return total


def measure(run: inference.LoadedRun, docs, examples: dict, gen_tokens: int, targets: Sequence[str]) -> dict[str, Any]:
    """What the report compares: parameters, non-zeros, bytes on the device (all weights, and the
    compressed projections' alone), quality, generation speed."""
    bits = run.model_cfg.stored_quant.bits if run.model_cfg.stored_quant else 4
    leaves = jax.tree.leaves(run.params)
    floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    out: dict[str, Any] = {
        "parameters": quant.count(run.params, bits),
        "nonzero_float_weights": int(sum(int(jnp.count_nonzero(x)) for x in floats)),
        "device_bytes": _params_bytes(run.params),
        "target_bytes": _target_bytes(run.params, targets),
    }
    out.update(methods.sparsity_of(run.params))
    if docs is not None:
        out["corpus"] = evaluate.perplexity(run, docs)
    out["tasks"] = {name: {k: v for k, v in evaluate.multiple_choice(run, ex).items() if k != "loglikelihoods"}
                    for name, ex in examples.items()}
    if gen_tokens > 0:
        gen = generate.Generator(run.model_cfg, run.params, run.mesh, run.rules, run.param_shardings, run.tokenizer,
                                 run.model_spec.graphdef)
        rows = run.batch_shards
        gen.generate([PROMPT] * rows, max_new_tokens=gen_tokens, eos_id=None)  # compiles
        started = time.perf_counter()
        gen.generate([PROMPT] * rows, max_new_tokens=gen_tokens, eos_id=None)
        seconds = time.perf_counter() - started
        out["generation"] = {"rows": rows, "new_tokens": gen_tokens, "seconds": seconds,
                             "tokens_per_second": rows * gen_tokens / seconds}
    return out


def compress_run(run_dir, output, overrides: Sequence[tuple[str, Any]] = (), *, step: int | None = None,
                 corpus: str = "val", tasks: Sequence[str] = (), max_tokens: int = 200_000,
                 gen_tokens: int = 32) -> dict[str, Any]:
    """Write the compressed run directory `output` and return its report (see the module's docstring)."""
    output = pathlib.Path(output)
    run_dir_lib.check_new_output(output, is_a_run=True)
    examples = {pathlib.Path(t).stem: evaluate.read_examples(t) for t in tasks}  # bad files fail before loading
    run = inference.load_run(run_dir, step=step)
    cfg = _resolve(run, overrides)
    with checkpoint.Checkpointer(run.run_dir / "checkpoints") as ckpt:
        meta = ckpt.read_meta(run.step)
    imported = bool(meta.get("imported_from"))
    out_cfg = inference.model_config(cfg, run.mesh.devices.flat[0].platform)
    settings = methods.Settings.of(cfg.compress, out_cfg)
    calibration = _calibration(run, cfg, imported) if settings.calibrates else None
    docs = None
    if corpus != "none":
        docs, _ = evaluate.corpus_documents(run, corpus, max_tokens=max_tokens)
    source = dataclasses.replace(run, model_cfg=_float_cfg(run.model_cfg))
    if source.model_cfg != run.model_cfg:  # a QAT run: its float kernels, measured as the float model they are
        source = _variant(run, run.cfg, source.model_cfg, run.params)
    log.info("measuring %s step %d", run.run_dir, run.step)
    targets = sorted({name for transform in out_cfg.transforms for name in transform.targets})
    before = measure(source, docs, examples, gen_tokens, targets)
    with jax.set_mesh(run.mesh):
        params, done = methods.compress_params(source.params, source.model_cfg, out_cfg, cfg.compress, mesh=run.mesh,
                                               rules=run.rules, calibration=calibration)
    compressed = _variant(run, cfg, out_cfg, params)
    log.info("measuring the compressed model")
    after = measure(compressed, docs, examples, gen_tokens, targets)
    with run_dir_lib.new_output(output, is_a_run=True) as partial:  # whole or not at all
        with cfg.unlocked():
            cfg.run.name, cfg.run.output_dir = output.name, str(output.parent)
        meta = {"config": cfg.to_dict(), "tokenizer_sha256": run.tokenizer.sha256, "params_only": True,
                "compressed_from": {"run_dir": str(run.run_dir.resolve()), "step": run.step,
                                    **{k: v for k, v in meta.items() if k == "imported_from"}}}
        if jax.process_index() == 0:
            write_bytes_atomically(partial / "config.json", json.dumps(cfg.to_dict(), indent=2).encode())
            shutil.copyfile(run.run_dir / run.tokenizer.file_name, partial / run.tokenizer.file_name)
        with checkpoint.Checkpointer(partial / "checkpoints", async_save=False) as ckpt:
            ckpt.save(run.step, {"params": compressed.params}, meta=meta, force=True)
            ckpt.wait()
            ckpt.record_manifest(run.step)
        report = {
            "source": {"run_dir": str(run.run_dir), "step": run.step},
            "output": str(output),
            "compress": {k: cfg.compress[k] for k in cfg.compress.keys()},
            "devices": f"{len(run.mesh.devices.flat)}x {run.mesh.devices.flat[0].device_kind}",
            "corpus": corpus,
            "seconds": done["seconds"],
            "calibration": {"sequences": done["calibration_sequences"], "seq_len": done["calibration_seq_len"]},
            "targets": done["targets"],
            "before": before,
            "after": after,
            # the source's checkpoint holds its optimizer state and data position too (a compressed one: parameters)
            "disk_bytes": {"checkpoint": _dir_bytes(partial / "checkpoints" / str(run.step)),
                           "source_checkpoint": _dir_bytes(run.run_dir / "checkpoints" / str(run.step))},
        }
        # The same weights in bfloat16, the usual serving format: the whole model's, and the compressed projections'.
        report["bf16_bytes"] = 2 * before["parameters"]
        report["bf16_target_bytes"] = before["target_bytes"] // np.dtype(run.model_cfg.param_dtype).itemsize * 2
        if jax.process_index() == 0:
            write_bytes_atomically(partial / "compress_report.json", json.dumps(report, indent=2).encode())
            write_bytes_atomically(partial / "compress_report.md", format_report(report).encode())
    return report


def _fmt(x, spec=".4g") -> str:
    return "-" if x is None else format(x, spec)


def format_report(r: dict[str, Any]) -> str:
    """The report as Markdown: a table of before and after."""
    b, a = r["before"], r["after"]
    co = r["compress"]
    what = []
    if co["quantize"]:
        method = co["method"] + (", embed by rtn" if co["method"] != "rtn" and "embed" in r["targets"] else "")
        what.append(f"{co['quantize']} ({'symmetric' if co['symmetric'] else 'asymmetric'}, group "
                    f"{co['group'] or 'per channel'}, {method})")
    if co["sparsity"] > 0:
        what.append(f"{co['sparsity']:.0%} pruned ({co['criterion']}, {co['pattern']}, {co['scope']})")
    rows = [("parameters", b["parameters"], a["parameters"], ",d"),
            ("pruned weights", b["pruned"], a["pruned"], ",d"),
            ("weight bytes on the device", b["device_bytes"], a["device_bytes"], ",d")]
    lines = [f"# Compressed {r['source']['run_dir']} (step {r['source']['step']})", "",
             f"{'; '.join(what)}; targets: {', '.join(r['targets'])}; {r['devices']}; "
             f"{r['seconds']:.1f} s" + (f", calibrated on {r['calibration']['sequences']} x "
                                        f"{r['calibration']['seq_len']} tokens" if r['calibration']['sequences'] else ""),
             "", "| | before | after |", "|---|---:|---:|"]
    lines += [f"| {name} | {_fmt(x, f)} | {_fmt(y, f)} |" for name, x, y, f in rows]
    lines.append(f"| the same weights in bfloat16 | {r['bf16_bytes']:,d} | after / bf16: "
                 f"{a['device_bytes'] / r['bf16_bytes']:.3f} |")
    lines.append(f"| bytes of the compressed projections | {b['target_bytes']:,d} | {a['target_bytes']:,d} |")
    lines.append(f"| the same projections in bfloat16 | {r['bf16_target_bytes']:,d} | after / bf16: "
                 f"{a['target_bytes'] / r['bf16_target_bytes']:.3f} |")
    if "corpus" in b:
        for key in ("loss", "perplexity", "bits_per_byte"):
            lines.append(f"| {key} ({r['corpus']}) | {_fmt(b['corpus'][key])} | {_fmt(a['corpus'][key])} |")
    for name in b["tasks"]:
        for key in ("acc", "acc_norm"):
            lines.append(f"| {name} {key} ({b['tasks'][name]['examples']} examples) | {_fmt(b['tasks'][name][key])} | "
                         f"{_fmt(a['tasks'][name][key])} |")
    if "generation" in b:
        lines.append(f"| generation tokens/s ({b['generation']['rows']} rows) | "
                     f"{b['generation']['tokens_per_second']:.1f} | {a['generation']['tokens_per_second']:.1f} |")
    lines.append(f"| checkpoint bytes on disk (the source's with its optimizer state) | "
                 f"{r['disk_bytes']['source_checkpoint']:,d} | {r['disk_bytes']['checkpoint']:,d} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda: _main(argv), resume="run the same command again with a new --output")


make_parser = commands.compress_parser  # the command line, declared in jaxlm.commands (light to import)


def _main(argv: Sequence[str] | None) -> int:
    parser = make_parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    overrides = []
    for item in rest:
        key, eq, value = item.partition("=")
        if not key.startswith("--config.") or not eq:
            parser.error(f"unrecognized argument {item!r} (config keys are given as --config.compress.<key>=<value>)")
        overrides.append((key[len("--config."):], value))
    command_logging()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    report = compress_run(args.run_dir, args.output, overrides, step=args.step, corpus=args.corpus, tasks=tasks,
                          max_tokens=args.max_tokens, gen_tokens=args.gen_tokens)
    print(format_report(report))
    print(f"jaxlm: wrote compressed run directory {args.output}: evaluate, generate or explore it, export it, or "
          f"fine-tune it with --config.run.init_from={args.output}")
    return 0
