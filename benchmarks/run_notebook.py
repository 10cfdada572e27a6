"""Execute notebooks top to bottom in a real Jupyter kernel (nbclient) and print their text outputs.

    python benchmarks/run_notebook.py notebooks/01_quickstart.ipynb              # this Python's kernel
    python benchmarks/run_notebook.py notebooks/*.ipynb --save /tmp/executed     # keep the outputs too

For a machine without Jupyter's front end (the lent GPU machine in benchmarks/gpu_session.sh): the
kernel is `python3`, i.e. this interpreter with ipykernel, started in the notebook's folder with this
environment (so JAXLM_RUNS_DIR, XLA_FLAGS, PYTHONPATH reach it). Exits 1 on the first failing cell,
printing the cell and its traceback.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--save", help="write each executed notebook, outputs included, into this folder")
    args = parser.parse_args(argv)
    import nbclient
    import nbformat

    for name in args.notebooks:
        path = pathlib.Path(name).resolve()
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        client = nbclient.NotebookClient(nb, timeout=args.timeout, kernel_name=args.kernel,
                                         resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except nbclient.exceptions.CellExecutionError as e:
            print(f"# {name}: a cell failed after {time.time() - t0:.0f}s\n{e}", file=sys.stderr)
            return 1
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                text = out.get("text", "") or "".join(out.get("data", {}).get("text/plain", ""))
                if out.get("data", {}).get("image/png"):
                    text += "[a PNG image]"
                if text.strip():
                    print(text.rstrip())
        print(f"# {name}: ran in {time.time() - t0:.0f}s, no errors", flush=True)
        if args.save:
            pathlib.Path(args.save).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, pathlib.Path(args.save) / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
