"""Compressing a trained model: quantization (RTN, GPTQ), pruning (magnitude, Wanda, N:M), the report
(`python -m jaxlm.compress`, whose functions are `jaxlm.compress.cli.compress_run` and `format_report`), and what
training needs of them (masked updates, gradual pruning). The package itself imports nothing, so training can import
`jaxlm.compress.prune` without the command's dependencies."""
