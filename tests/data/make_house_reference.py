"""Writes tests/data/house_reference_594be22.json for tests/test_house_reference.py: the metrics that
short tiny runs log, step by step, with the code of commit 594be22 (before issue 46's second plan of the
house), and the machine they were computed on (`floats.machine()`). The runs use the checkout that
JAXLM_CHECKOUT names (default: this one), so it can write the reference from that commit's code:

    git worktree add /tmp/old 594be22
    cd /tmp/old && JAXLM_CHECKOUT=/tmp/old PYTHONPATH=/tmp/old python /path/to/tests/data/make_house_reference.py \
        /path/to/tests/data

The test imports CASES and run_case from here and runs them with this checkout's code.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

STEPS_LONG, STEPS_SHORT = 50, 20
# name: (devices, steps, overrides of configs/tiny.py)
CASES = {
    "one_device": (1, STEPS_LONG, {}),
    "mesh_2x2x2": (8, STEPS_LONG, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
    "lora": (1, STEPS_SHORT, {"lora.rank": 8}),
    "qlora": (1, STEPS_SHORT, {"lora.rank": 8, "lora.quantize_base": "nf4"}),
    "gradual_pruning": (1, STEPS_SHORT, {"compress.sparsity": 0.5, "compress.prune_start": 2,
                                         "compress.prune_end": 12, "compress.prune_every": 2}),
    "stage_2": (2, STEPS_SHORT, {"mesh.stage": 2}),
    "fp8": (1, STEPS_SHORT, {"model.matmul": "fp8"}),
    # fine-tuned from an int4 GPTQ compression (`_gptq_base`) of a 20-step run: the integer kernels frozen
    "gptq_init_from": (1, STEPS_SHORT, {"run.init_from": "{directory}/gptq_base_int4"}),
}
# What a run logs that depends on time, the host or the energy estimate: not compared.
VARYING = ("per_s", "tflops", "energy", "power", "co2e", "device_hours", "mfu", "memory", "bytes")


def kept(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s") and not any(part in k for part in VARYING)}


def _jaxlm(name: str, command: str, args: list[str], devices: int, xla_flags: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{xla_flags} --xla_force_host_platform_device_count={devices}".strip()}
    root = pathlib.Path(__file__).resolve().parent.parent.parent
    result = subprocess.run([sys.executable, "-m", f"jaxlm.{command}", *args], cwd=os.environ.get("JAXLM_CHECKOUT", root),
                            env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: jaxlm.{command} exit {result.returncode}\n{result.stderr[-3000:]}")


def _train_args(name: str, directory: pathlib.Path, steps: int, overrides: dict) -> list[str]:
    return ["--config=configs/tiny.py", f"--config.run.output_dir={directory}", f"--config.run.name={name}",
            f"--config.run.steps={steps}", f"--config.data.cache_dir={directory}/cache", "--config.run.compile_cache_dir=",
            *(f"--config.{k}={str(v).format(directory=directory)}" for k, v in overrides.items())]


def _gptq_base(directory: pathlib.Path, xla_flags: str) -> None:
    _jaxlm("gptq_init_from", "train", _train_args("gptq_base", directory, STEPS_SHORT, {}), 1, xla_flags)
    _jaxlm("gptq_init_from", "compress", [f"--run_dir={directory}/gptq_base", f"--output={directory}/gptq_base_int4",
                                          "--config.compress.quantize=int4", "--config.compress.method=gptq"], 1, xla_flags)


PRELUDES = {"gptq_init_from": _gptq_base}


def run_case(name: str, directory: pathlib.Path, xla_flags: str = "") -> list[dict]:
    devices, steps, overrides = CASES[name]
    if name in PRELUDES:
        PRELUDES[name](directory, xla_flags)
    _jaxlm(name, "train", _train_args(name, directory, steps, overrides), devices, xla_flags)
    lines = (directory / name / "metrics.jsonl").read_text().splitlines()
    return [kept(json.loads(line)) for line in lines]


def main(out: str) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import floats

    with tempfile.TemporaryDirectory() as tmp:
        metrics = {name: run_case(name, pathlib.Path(tmp)) for name in CASES}
    record = {"made_on": floats.machine(""), "metrics": metrics}
    pathlib.Path(out, "house_reference_594be22.json").write_text(json.dumps(record, indent=0) + "\n")
    print("wrote", sum(len(v) for v in metrics.values()), "records")


if __name__ == "__main__":
    main(sys.argv[1])
