"""Wall time of every command's `--help` and of a bad flag's one-line error (issue 48 item 8): what a
user waits for before the command says anything.

    python benchmarks/cli_startup.py                 # 5 runs per command, the median
    python benchmarks/cli_startup.py --runs 9 --json startup.json

Each run is a fresh `python -m jaxlm.<command>` process (the operating system's file cache warm after
the first), timed from its start to its exit; the modules it imported by then are counted with
`-X importtime` in one more run, and whether JAX was among them is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMANDS = {  # the module, a bad flag (its one-line error, exit 2)
    "train": ("train", ["--config=configs/tiny.py", "--config.model.d_modle=3"]),
    "evaluate": ("evaluate", ["--run_dir=runs", "--batch_size=-1"]),
    "generate": ("generate", ["--run_dir=runs", "--temperature=nan"]),
    "hf": ("hf", ["export", "--run_dir=runs", "--output=x", "--max_shard_gb=nan"]),
    "compress": ("compress", ["--run_dir=runs", "--output=x", "--step=-1"]),
    "data.prepare": ("data.prepare", ["--input=x", "--tokenizer=x", "--output=x", "--workers=0"]),
    "data.tokenizer": ("data.tokenizer", ["train", "--input=x", "--output=x", "--vocab_size=x"]),
    "plan": ("plan", ["--config=configs/tiny.py", "--devices=0"]),
    "experiment": ("experiment", ["x.py", "--parallel=-1"]),
    "doctor": ("doctor", ["--matmul_size=0"]),
}


def _time(argv: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
    return time.perf_counter() - start, done.returncode, done.stderr


def _imports_jax(argv: list[str]) -> bool:
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return any(line.split("|")[-1].strip() == "jax" for line in done.stderr.splitlines() if "|" in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    for name, (module, bad) in COMMANDS.items():
        for what, argv in (("--help", ["-m", f"jaxlm.{module}", "--help"]), ("bad flag", ["-m", f"jaxlm.{module}", *bad])):
            times, codes = [], set()
            for _ in range(args.runs):
                seconds, code, _ = _time(argv)
                times.append(seconds)
                codes.add(code)
            rows.append({"command": name, "what": what, "median_s": round(statistics.median(times), 3),
                         "min_s": round(min(times), 3), "exit": sorted(codes), "imports_jax": _imports_jax(argv)})
            print(f"{name:16} {what:9} {rows[-1]['median_s']:6.2f} s (min {rows[-1]['min_s']:.2f}), exit "
                  f"{rows[-1]['exit']}, JAX imported: {rows[-1]['imports_jax']}", flush=True)
    if args.json:
        import importlib.metadata

        meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "cpu": platform.processor(),
                "jax": importlib.metadata.version("jax"), "runs": args.runs}
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
