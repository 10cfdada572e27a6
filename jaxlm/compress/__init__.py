"""Compressing a trained model: quantization (RTN, GPTQ), pruning (magnitude, Wanda, N:M), the report
(`python -m jaxlm.compress`), and what training needs of them (masked updates, gradual pruning)."""


def __getattr__(name):
    """`compress_run` and `format_report` (jaxlm.compress.cli), imported on first use: training imports
    `jaxlm.compress.prune` without the command's dependencies."""
    if name in ("compress_run", "format_report"):
        from jaxlm.compress import cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
