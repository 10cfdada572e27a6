"""Wall time and peak host memory of importing and exporting a Hugging Face checkpoint (issue 19).

    python benchmarks/hf_convert.py                         # the 1b recipe's shape, bfloat16 files
    python benchmarks/hf_convert.py --recipe 125m --json hf.json

No checkpoint can be downloaded here, so the benchmark writes one: a Llama directory with the
recipe's shape (config.json, random bfloat16 weights in safetensors shards of about 2 GB, as
`save_pretrained` shards, a byte tokenizer). Then, each in a fresh process on the devices here:
`jaxlm.hf import` (float32 parameters, the default) and `jaxlm.hf export` back to bfloat16. Each
process reports its wall time and its peak resident memory (`ru_maxrss`: the parameters on a CPU
device live in host memory, so on a CPU this includes them; file pages read through safetensors'
memory map count too).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARD_BYTES = 2 * 10**9

MEASURE = """
import json, resource, sys, time
from jaxlm import hf
start = time.perf_counter()
if sys.argv[1] == "import":
    hf.import_checkpoint(sys.argv[2], sys.argv[3])
else:
    hf.export_run(sys.argv[2], sys.argv[3], dtype="bfloat16")
wall = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"wall_s": round(wall, 2), "peak_rss_gib": round(peak, 2)}))
"""


def write_checkpoint(recipe: str, directory: pathlib.Path) -> dict:
    """A Llama checkpoint of the recipe's shape with random bfloat16 weights; returns its sizes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jaxlm import config
    from jaxlm.data.tokenizer import SentencePieceTokenizer
    from jaxlm.models import hf as hf_map
    from jaxlm.models import transformer

    cfg = config.recipe(recipe)
    model_cfg = transformer.ModelConfig.from_config(cfg.model, "cpu", log_choice=False)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(
        hf_map.hf_config(model_cfg, "llama", bos_id=2, eos_id=3, pad_id=None, dtype="bfloat16")))
    SentencePieceTokenizer.train([], 260, "byte").save(directory / "tokenizer.model")
    layer_parts, outside = hf_map.name_map(model_cfg, "llama")
    shapes = {part.hf: part.hf_shape for part in outside.values()}
    for i in range(model_cfg.n_layers):
        shapes.update({part.hf.format(layer=i): part.hf_shape for part in layer_parts.values()})
    rng = np.random.default_rng(0)
    shards, pending, size, total = [], {}, 0, 0
    for name, shape in shapes.items():
        tensor = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if pending and size + tensor.nbytes > SHARD_BYTES:
            shards.append(pending)
            pending, size = {}, 0
        pending[name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    shards.append(pending)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {"parameters": total // 2, "bytes": total, "files": len(shards)}


def measure(command: str, source: pathlib.Path, output: pathlib.Path) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE, command, str(source), str(output)], cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="1b")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="hf_convert-", dir=args.dir))
    try:
        started = time.perf_counter()
        made = write_checkpoint(args.recipe, root / "hf")
        made["write_s"] = round(time.perf_counter() - started, 1)
        results = {
            "recipe": args.recipe, "checkpoint": made,
            "import": measure("import", root / "hf", root / "run"),
            "export": measure("export", root / "run", root / "exported"),
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "jax": importlib.metadata.version("jax"),
            "safetensors": importlib.metadata.version("safetensors"),
        }
        import_bytes = sum(f.stat().st_size for f in (root / "run").rglob("*") if f.is_file())
        results["import"]["run_dir_gib"] = round(import_bytes / 2**30, 2)
        print(json.dumps(results, indent=2))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
