"""The command lines of jaxlm's commands, light to import (argparse, `jaxlm.cli` and a few tables), so
that `python -m jaxlm.<command>` answers `--help` and a bad flag in a fraction of a second, before JAX
is imported (`parse_early`, which the package's `__init__` calls for `python -m jaxlm.<command>`;
`benchmarks/cli_startup.py` measures it). Each command module takes its parser from here
(`make_parser = commands.<name>_parser`): the flags are declared once, and the generated tests
(tests/test_cli_numbers.py, tests/test_paths.py) read them from the commands. `jaxlm.data.prepare` and
`jaxlm.data.tokenizer` import no JAX and keep their parsers.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import pathlib
import sys
from collections.abc import Sequence

from jaxlm import cli, overrides, paths, roofline
from jaxlm.data import sources
from jaxlm.errors import EXIT_ENVIRONMENT, EnvironmentFailure, UserError, report_error

ADAPTER_CHOICES = ("merge", "peft")  # hf export --adapters
DISTRIBUTED_TIMEOUT_S = 300.0  # doctor --distributed_timeout_s: distributed.DEFAULT_TIMEOUT_S (tested equal)


def _doc(module: str) -> str:
    """A command module's docstring, read from its source without importing it (which would import JAX)."""
    origin = importlib.util.find_spec(module).origin
    with open(origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read()), clean=False) or ""


def evaluate_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.evaluate` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.evaluate", description=_doc("jaxlm.evaluate").split("\n\n")[0])
    parser.add_path("--run_dir", kind="dir", io="in", required=True,
                    help="a training run's directory (run.output_dir/run.name)")
    parser.add_number("--step", kind=int, minimum=0, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--corpus", default="val",
                        help="'val' (the run's validation split), a prepared directory, files/globs, or 'none'")
    parser.add_argument("--split", default="val", help="the split of a prepared directory: train or val")
    parser.add_argument("--format", default="auto", choices=sources.FORMATS + sources.SFT_FORMATS,
                        help="of raw corpus files (auto: by extension, or the run's data.format for an SFT run)")
    parser.add_argument("--chat_template", default=None,
                        help="chat rows: '' (the tokenizer's own), chatml, simple or a .jinja file (default: the run's)")
    parser.add_argument("--text_field", default="text", help="jsonl / parquet: the field with the text")
    parser.add_argument("--separator", default="", help="text files: split documents on this string")
    parser.add_number("--max_tokens", kind=int, minimum=0, allowed="0 (all) or more", default=1_000_000,
                      help="evaluate on about this many tokens; 0 = all")
    parser.add_argument("--tasks", default="", help="multiple-choice JSONL files, comma-separated")
    parser.add_argument("--lm_eval_tasks", default="",
                        help="lm-evaluation-harness tasks, comma-separated (hellaswag,arc_easy); needs the harness: "
                             "pip install 'jaxlm[eval]'")
    parser.add_path("--lm_eval_include_path", kind="dir", io="in", default=None,
                    help="a directory of your own harness task YAML files (adds to the harness's)")
    parser.add_number("--lm_eval_num_fewshot", kind=int, minimum=0, default=None,
                      help="examples before each question (default: each task's own)")
    parser.add_number("--lm_eval_limit", kind=int, minimum=1, default=None,
                      help="at most this many examples of each harness task (default: all)")
    parser.add_number("--seq_len", kind=int, minimum=2, default=None,
                      help="tokens per row (default: the run's data.seq_len)")
    parser.add_number("--batch_size", kind=int, minimum=1, default=None, help="rows per batch (default: the run's)")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the run's model.dtype)")
    parser.add_path("--output", kind="file", io="out", default=None,
                    help="results JSON (default: <run_dir>/eval-<step>.json)")
    return parser


def generate_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.generate` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.generate", description=_doc("jaxlm.generate").split("\n\n")[0])
    parser.add_path("--run_dir", kind="dir", io="in", required=True,
                    help="a training run's directory (run.output_dir/run.name)")
    parser.add_number("--step", kind=int, minimum=0, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt; repeat for a batch (with --chat: a user message, one conversation each)")
    parser.add_path("--prompts_file", kind="file", io="in",
                    help="a file with one prompt per line (adds to --prompt); a .jsonl file, or any with --chat: one "
                         "conversation per line, a JSON list of {role, content} messages or {\"messages\": [...]}")
    parser.add_argument("--chat", action="store_true",
                        help="prompt a chat model: each conversation rendered by the run's chat template with its "
                             "generation prompt; the completion is the assistant's answer")
    parser.add_argument("--messages", action="append", default=[],
                        help="a conversation as a JSON list of {\"role\": ..., \"content\": ...} messages, ending with "
                             "a user message (implies --chat); repeat for a batch")
    parser.add_argument("--system", default=None,
                        help="a system message before each conversation that has none (implies --chat)")
    parser.add_argument("--interactive", action="store_true",
                        help="chat in the terminal: one user message per line of standard input, the answers kept in "
                             "the conversation (and the KV cache); /reset starts over, /exit or end of input stops")
    parser.add_number("--num_samples", kind=int, minimum=1, default=1, help="completions per prompt")
    parser.add_number("--max_new_tokens", kind=int, minimum=1, default=128)
    parser.add_number("--temperature", minimum=0, allowed="0 (greedy) or a positive number", default=0.8,
                      help="0 = greedy")
    parser.add_number("--top_k", kind=int, minimum=0, allowed="0 (off) or a positive number of tokens", default=0,
                      help="0 = off")
    parser.add_number("--top_p", above=0, maximum=1, allowed="a probability in (0, 1]; 1 is off", default=1.0,
                      help="1 = off")
    parser.add_number("--seed", kind=int, minimum=0, default=0)
    parser.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the run's model.dtype)")
    parser.add_argument("--param_dtype", default=None, help="cast parameters as they load, e.g. bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    return parser


def hf_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.hf` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.hf", description=_doc("jaxlm.hf"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a Hugging Face model directory -> a jaxlm run directory")
    imp.add_path("--hf_dir", kind="dir", io="in", required=True, help="config.json, safetensors, tokenizer")
    imp.add_path("--output", kind="dir", io="out", required=True, help="the run directory to write (new)")
    imp.add_argument("--param_dtype", default="float32", help="float32 (default: for training) | bfloat16 | float16")
    imp.add_path("--tokenizer", kind="any", io="in", default="", help="a tokenizer file, where the directory has none")
    exp = commands.add_parser("export", help="a jaxlm run -> a Hugging Face model directory")
    exp.add_path("--run_dir", kind="dir", io="in", required=True)
    exp.add_path("--output", kind="dir", io="out", required=True, help="the directory to write (new)")
    exp.add_number("--step", kind=int, minimum=0, default=None, help="the checkpoint (default: the newest that loads)")
    exp.add_argument("--dtype", default="", help="float32 | bfloat16 | float16 (default: the run's param_dtype)")
    exp.add_number("--max_shard_gb", above=0, allowed="a positive size in GB", default=5.0,
                   help="safetensors files of at most this size")
    exp.add_argument("--adapters", default="merge", choices=ADAPTER_CHOICES,
                     help="a LoRA run: merge the adapters into the weights, or write the adapter alone in PEFT's "
                          "format (--output is then the adapter's directory)")
    # A directory or a hub id, written into adapter_config.json and never opened here: not one path.
    exp.add_argument("--base_model", default="",
                     help="--adapters=peft: the base_model_name_or_path to record (default: the Hugging Face "
                          "model the run's base was imported from)")
    exp.add_argument("--with_base", action="store_true",
                     help="--adapters=peft: also write the run's base (a QLoRA run's dequantized) in <output>/base "
                          "and point the adapter at it")
    return parser


def compress_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.compress` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.compress", description=_doc("jaxlm.compress.cli"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_path("--run_dir", kind="dir", io="in", required=True, help="the trained run to compress")
    parser.add_path("--output", kind="dir", io="out", required=True, help="the run directory to write (new)")
    parser.add_number("--step", kind=int, minimum=0, default=None, help="the checkpoint (default: the newest that loads)")
    parser.add_argument("--corpus", default="val", help="what the report measures quality on: val (the run's "
                        "validation split), text files, a prepared directory, or none")
    parser.add_number("--max_tokens", kind=int, minimum=0, allowed="0 (all) or more", default=200_000,
                      help="of --corpus, at most this many tokens")
    parser.add_argument("--tasks", default="", help="comma-separated multiple-choice JSONL files (jaxlm.evaluate's)")
    parser.add_number("--gen_tokens", kind=int, minimum=0, default=32, help="new tokens per row in the generation "
                      "speed measurement (0 = none)")
    return parser


def plan_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.plan` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.plan", description=_doc("jaxlm.plan").splitlines()[2], allow_abbrev=False)
    parser.add_number("--devices", kind=int, minimum=1, allowed="a positive number of devices", default=None,
                      help="number of devices the run uses (for a TPU target, default: the chips of --topology "
                           "x --slices)")
    parser.add_number("--device_memory_gib", above=0, allowed="a positive size in GiB", default=None,
                      help="memory of one device (default 80, or the --target's)")
    parser.add_argument("--target", choices=sorted(roofline.TARGETS), default=None,
                        help="compile the real GPU or TPU program for compile-only devices of this kind (no GPU or "
                             "TPU needed; `make h100-env`, `make tpu-env`) and report its memory and roofline: "
                             "kernels, collectives, the roofline-bound MFU")
    parser.add_argument("--topology", default=None,
                        help="a TPU target's slice, as libtpu names it (v5p:2x2x1, v5e:2x4, v6e:2x4, v5p:2x4x4); "
                             "default: Cloud's shape for --devices chips")
    parser.add_number("--slices", kind=int, minimum=1, allowed="a positive number of TPU slices", default=1,
                      help="a TPU target's slices of --topology each, joined over DCN (multi-slice): data across "
                           "them (mesh.hybrid=slice, set where the config leaves it empty), the rest within each")
    parser.add_argument("--platform", choices=("gpu", "tpu", "cpu"), default="gpu",
                        help="the accelerator planned for: picks the kernel model.attention=auto would (default gpu)")
    parser.add_argument("--compile", action="store_true",
                        help="also compile the train step ahead of time and report XLA's memory analysis")
    parser.add_argument("--choose", action="store_true",
                        help="with --target: also compile each remat policy at several micro-batch counts and "
                             "choose the pair with the best roofline-bound MFU that fits without recompute XLA adds")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def experiment_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.experiment` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.experiment", description=_doc("jaxlm.experiment").split("\n\n")[0])
    parser.add_path("experiment", kind="file", io="in", help="a Python file defining EXPERIMENT = Experiment(...)")
    parser.add_number("--parallel", kind=int, minimum=0, allowed="1 or more, or 0 to run in this process", default=1,
                      help="runs at once; 0 = in this process, one by one")
    parser.add_argument("--print_commands", "--print-commands", action="store_true",
                        help="print one command per unfinished run (for a cluster) instead of running")
    parser.add_argument("--collect", action="store_true", help="only collect the results of the runs on disk")
    parser.add_argument("--search", choices=("grid", "random", "optuna"), help="search the search_space")
    parser.add_number("--trials", kind=int, minimum=1, help="random and optuna searches: how many trials in all")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--early_stop", "--early-stop", action="store_true", default=None,
                      help="stop runs whose validation loss is worse than the median at the same step")
    stop.add_argument("--no_early_stop", "--no-early-stop", action="store_false", dest="early_stop",
                      help="optuna: never prune")
    parser.add_argument("--seeds", type=_parse_seeds, help="comma-separated seeds instead of the declaration's")
    parser.add_argument("--set", type=_parse_set, action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run (repeatable)")
    parser.add_argument("--only", type=lambda s: [v for v in s.split(",") if v], help="comma-separated variants to run")
    parser.add_path("--output_dir", "--output-dir", kind="dir", io="out", default="runs",
                    help="runs go to <output_dir>/<experiment>/")
    parser.add_path("--results_dir", "--results-dir", kind="dir", io="out",
                        help="where results.md/csv and loss.png go (default: the sweep's directory)")
    return parser


def doctor_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.doctor` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.doctor", description=_doc("jaxlm.doctor").splitlines()[0])
    parser.add_argument("--expect", choices=("auto", "gpu", "cpu", "tpu"), default="auto",
                        help="the platform JAX must use (auto: a GPU where nvidia-smi lists one)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_number("--matmul_size", kind=int, minimum=1, default=None, help="n of the n x n x n bf16 matmul timing")
    parser.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (with --distributed)")
    parser.add_number("--num_processes", kind=int, minimum=1, default=None)
    parser.add_number("--process_id", kind=int, minimum=0, default=None)
    parser.add_number("--distributed_timeout_s", above=0, default=DISTRIBUTED_TIMEOUT_S,
                      help="how long to wait for the coordinator and the other processes")
    return parser


def _parse_set(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: use KEY=VALUE, e.g. run.steps=20")
    return key.removeprefix("config."), value


def _parse_seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: use comma-separated integers, e.g. 0,1,2") from None


# ----------------------------------------------------------------------------- generate's prompts

# generate's lines for a command line without anything to complete (`generate._main`, `check_generate`)
NO_PROMPT = "give at least one --prompt=TEXT (or --prompts_file=FILE)"
NO_CONVERSATION = ("give at least one conversation: --prompt=TEXT (a user message), --messages=JSON or "
                   "--prompts_file=FILE.jsonl")
INTERACTIVE_WITH_PROMPTS = ("--interactive reads the conversation from standard input; drop --prompt, --messages "
                            "and --prompts_file (a system message: --system)")


def generate_is_chat(args: argparse.Namespace) -> bool:
    """Whether generate's command line prompts a chat model (`--chat`, or a flag that implies it)."""
    return bool(args.chat or args.messages or args.system is not None or args.interactive
                or (args.prompts_file or "").lower().endswith(".jsonl"))


def read_prompts_file(path: str) -> list[tuple[int, str]]:
    """The (line number, text) of each non-blank line of --prompts_file."""
    try:
        with open(path, encoding="utf-8") as f:
            return [(number, line.rstrip("\n")) for number, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise UserError(f"--prompts_file={path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts_file={path} is not UTF-8 text (byte {e.start}); give a text file") from None


def conversation(text: str, where: str, system: str | None) -> list[dict[str, str]]:
    """A conversation from its JSON text (`sft.check_prompt`), with the system message put first if it has none."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at character {e.pos}); give a list of {{\"role\": ..., "
                        f"\"content\": ...}} messages") from None
    # (`python -m jaxlm.data.tokenizer` must not find its module imported before it runs: runpy warns, running it twice)
    from jaxlm.data import sft  # local import: sft imports jaxlm.data.tokenizer (above)

    messages = sft.check_prompt(row, where)
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def chat_prompts(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """The conversations the command line gives: --prompt (a user message each), --messages, and
    --prompts_file's lines."""
    first = [{"role": "system", "content": args.system}] if args.system is not None else []
    conversations = [[*first, {"role": "user", "content": p}] for p in args.prompt]
    conversations += [conversation(m, f"--messages #{i}", args.system) for i, m in enumerate(args.messages, 1)]
    if args.prompts_file:
        conversations += [conversation(line, f"{args.prompts_file}:{number}", args.system)
                          for number, line in read_prompts_file(args.prompts_file)]
    return conversations


def check_generate(args: argparse.Namespace) -> None:
    """What generate's command line alone shows to be wrong, the first line `generate._main` would give
    before it reads --prompts_file (read once, by the command: it may be a pipe): --interactive with
    prompts, a --messages that is not a conversation, nothing to complete."""
    if args.interactive:
        if args.prompt or args.messages or args.prompts_file:
            raise UserError(INTERACTIVE_WITH_PROMPTS)
        return
    if generate_is_chat(args):
        for i, m in enumerate(args.messages, 1):
            conversation(m, f"--messages #{i}", args.system)
        if not (args.prompt or args.messages or args.prompts_file):
            raise UserError(NO_CONVERSATION)
    elif not (args.prompt or args.prompts_file):
        raise UserError(NO_PROMPT)


# ----------------------------------------------------------------------------- before JAX

# The commands `parse_early` answers, by module, and their parsers
EARLY = {
    "jaxlm.evaluate": evaluate_parser, "jaxlm.generate": generate_parser, "jaxlm.hf": hf_parser,
    "jaxlm.compress": compress_parser, "jaxlm.compress.cli": compress_parser, "jaxlm.plan": plan_parser,
    "jaxlm.experiment": experiment_parser, "jaxlm.doctor": doctor_parser,
}
TRAIN_USAGE = """usage: python -m jaxlm.train --config=configs/<recipe>.py [--config.<section>.<key>=<value> ...]

Train (or resume) the run that the recipe and the overrides describe, in run.output_dir/run.name.
Recipes: {recipes}.
Every key, its default and what it means: docs/config-reference.md; the guides: docs/."""


# The flags of a multi-process launch that train and hf take off their command line before parsing it
# (`distributed.pop_flags`; distributed.FLAGS, tested equal)
LAYOUT_FLAGS = ("coordinator", "num_processes", "process_id", "distributed_timeout_s")


def parse_early(module: str, argv: Sequence[str]) -> None:
    """For `python -m <module> <argv>`: answer --help and refuse a bad flag (one line, exit 2 or 74)
    now, before the command imports JAX, and what the command line alone shows to be wrong where the
    command checks it first (generate's prompts, evaluate's --output); return when the arguments parse
    (the command parses and checks them again). Train's config overrides are checked against the base config's keys and types
    (`overrides.check_early`); their values' ranges later, by the typed sections that own them."""
    try:
        if module == "jaxlm.train" and {"-h", "--help"} & set(argv):
            print(TRAIN_USAGE.format(recipes=", ".join(overrides.recipe_names())))
            sys.exit(0)
        if module == "jaxlm.train":  # the recipe's file, and each override's key and type
            overrides.check_early([a for a in argv if a[2:].partition("=")[0] not in LAYOUT_FLAGS
                                   or not a.startswith("--")])
            return
        parser = EARLY.get(module)
        if parser is None:
            return
        if module == "jaxlm.plan":  # (its --config arguments are the recipe's, checked as train's)
            parser().parse_args([a for a in argv if not a.startswith("--config")])
            overrides.check_early([a for a in argv if a.startswith("--config")])
        elif module == "jaxlm.experiment":  # (--set: every run's overrides)
            overrides.check_pairs(parser().parse_args(list(argv)).set)
        elif module == "jaxlm.hf":  # (a multi-process launch's flags are read by `distributed.pop_flags`)
            parser().parse_args([a for a in argv if a[2:].partition("=")[0] not in LAYOUT_FLAGS
                                 or not a.startswith("--")])
        elif module.startswith("jaxlm.compress"):  # (--config.compress.<key> overrides follow its flags)
            parser().parse_known_args(list(argv))
        elif module == "jaxlm.generate":  # (and the prompts it is given)
            check_generate(parser().parse_args(list(argv)))
        elif module == "jaxlm.evaluate":  # (and --output, the first thing `evaluate._main` checks)
            args = parser().parse_args(list(argv))
            try:
                sources.unescape(args.separator)  # (before --output in `evaluate._main`)
            except UnicodeDecodeError:
                return  # (the command reports it as it always has)
            if args.output:
                try:
                    paths.check_output_file(pathlib.Path(args.output))
                except OSError:
                    return  # (the command reports the machine's failure as it always has)
        else:
            parser().parse_args(list(argv))
    except UserError as e:
        sys.exit(report_error(e))
    except EnvironmentFailure as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        sys.exit(EXIT_ENVIRONMENT)
