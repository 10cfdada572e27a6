"""The catalogue of bad inputs: each case runs a real jaxlm command in a subprocess and checks the
exit code, the one line it prints (`jaxlm: error: ...`, never a traceback) and, where a run
directory or a prepared corpus is involved, that nothing in it changed.

To add a case, add a row to CASES. Placeholders in the arguments: {case} (the case's own empty
directory), {run} (a trained run with checkpoints at steps 20 and 40, shared: cases must not
change it), {copy} (a copy of that run in the case's directory, for cases that damage it),
{corpus} (the run's text corpus), {prepared} (that corpus prepared with the run's tokenizer),
{tok} (the run's tokenizer). The cases selected run concurrently (three at a time) once, in a
module fixture; each test then checks one. Cases that need seconds of training or a signal are
marked slow (`make test-slow`).

Each case's command runs in its own process: most in a child forked from a server that imported
JAX, Flax and the jaxlm command modules once (tests/command_forks.py, which makes that child what
`python -m jaxlm.<command>` is once imported), so that a case costs its command's work rather than
seconds of imports; a case whose environment differs from the session's (JAX read its variables
in the server) or that is signalled at a line of its output runs as a real subprocess.
JAXLM_TEST_NO_FORK=1 runs every case as a real subprocess (to compare, or to debug the server).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from command_forks import CommandForks

from jaxlm.run_lock import RunLock
from tiny_run import ONE_DEVICE, ROOT, train_args


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    command: str  # the module after `jaxlm.`
    args: tuple[str, ...]
    code: int | tuple[int, ...]  # the exit code (or the codes allowed, for a signal whose moment varies)
    words: tuple[str, ...]  # all in the one `jaxlm: error:` line (code 2, 74), in stderr (75, 130), or in a warning (0)
    setup: Callable[[pathlib.Path, dict], None] | None = None
    unchanged: str = ""  # a placeholder whose files must be byte-identical afterwards
    # (signal, a stdout line prefix): sent when that line appears; a prefix "stderr:<text>" waits for a line of
    # stderr that starts with <text> instead (a command that reports its progress there)
    signal_after: tuple[str, str] | None = None
    signal_delay: float = 2.0  # with an empty prefix: sent this many seconds after the start
    file_size_limit: int = 0  # RLIMIT_FSIZE for the command: files cannot grow past it, as on a full disk
    then: str = ""  # "resumes": the same command afterwards exits 0
    env: tuple[tuple[str, str], ...] = ()
    one_device: bool = False
    slow: bool = False
    no_progress_bar: bool = False  # a data error found while preparing: stderr shows no progress bar before its line


def T(*flags: str) -> tuple[str, ...]:
    """`python -m jaxlm.train` with the tiny recipe, writing under the case's directory."""
    return ("--config=configs/tiny.py", "--config.run.output_dir={case}/runs", "--config.data.cache_dir={case}/cache",
            *flags)


def FACTS(*flags: str) -> tuple[str, ...]:
    """The arguments that trained {run}, pointed at {copy} (a copy of it), and more flags."""
    return ("@facts", *flags)


# ----------------------------------------------------------------------------- setups


HF_LLAMA = ('{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, '
            '"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}')


def _write(path: str, text: str) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        (case / path).parent.mkdir(parents=True, exist_ok=True)
        (case / path).write_text(text)
    return setup


def _exported(case: pathlib.Path, world: dict) -> None:
    """{case}/exported: the shared run as a Hugging Face model directory."""
    result = subprocess.run([sys.executable, "-m", "jaxlm.hf", "export", f"--run_dir={world['run']}",
                             f"--output={case / 'exported'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


def _exported_tied(case: pathlib.Path, world: dict) -> None:
    """{case}/exported with a config.json that ties the head its weights hold apart (an edited config)."""
    _exported(case, world)
    path = case / "exported" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tie_word_embeddings": True}))


def _exported_nan(case: pathlib.Path, world: dict) -> None:
    """{case}/exported with a nan in one weight (a damaged save)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    _exported(case, world)
    path = case / "exported" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].copy()
    tensors["model.norm.weight"][0] = np.nan
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_run(case: pathlib.Path, world: dict) -> pathlib.Path:
    shutil.copytree(world["run"], case / "facts")
    return case / "facts"


def _damage_checkpoints(*steps: int, how: str = "flip") -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        run = _copy_run(case, world)
        for step in steps:
            state = run / "checkpoints" / str(step) / "state"
            victim = max((f for f in state.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
            if how == "truncate":
                os.truncate(victim, victim.stat().st_size // 2)
            else:
                data = bytearray(victim.read_bytes())
                data[len(data) // 2] ^= 0xFF
                victim.write_bytes(bytes(data))
    return setup


def _edit_json(path: str, edit: Callable[[dict], None], *, copy_run: bool = True) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        root = _copy_run(case, world) if copy_run else case
        target = root / path
        data = json.loads(target.read_text())
        edit(data)
        target.write_text(json.dumps(data))
    return setup


def _remove(path: str) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        target = _copy_run(case, world) / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return setup


def _replace_run_file(path: str, text: str) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        (_copy_run(case, world) / path).write_text(text)
    return setup


def _copy_prepared(edit: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        shutil.copytree(world["prepared"], case / "prepared")
        edit(case / "prepared")
    return setup


def _truncate_shards(prepared: pathlib.Path) -> None:
    for shard in prepared.glob("train-*.tokens"):
        os.truncate(shard, shard.stat().st_size // 2)


def _unfinished(prepared: pathlib.Path) -> None:
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["complete"] = False
    (prepared / "manifest.json").write_text(json.dumps(manifest))


def _layout(value: int) -> Callable[[dict], None]:
    def edit(meta: dict) -> None:
        meta["param_layout"] = value
    return edit


def _both(*setups: Callable[[pathlib.Path, dict], None]) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        for s in setups:
            s(case, world)
    return setup


def _layout_everywhere(value: int) -> Callable[[pathlib.Path, dict], None]:
    def setup(case: pathlib.Path, world: dict) -> None:
        run = _copy_run(case, world)
        for meta in run.glob("checkpoints/*/meta/metadata"):
            data = json.loads(meta.read_text())
            data["param_layout"] = value
            meta.write_text(json.dumps(data))
            (meta.parents[1] / "jaxlm_manifest.json").unlink()  # edited on purpose: not damage
    return setup


def _model_edit(key: str, value) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        cfg["model"][key] = value
    return edit


def _recipe(text: str) -> Callable[[pathlib.Path, dict], None]:
    return _write("recipe.py", text)


def _untrained_source(case: pathlib.Path, world: dict) -> None:
    """A run directory with its config but no checkpoint yet."""
    (case / "src" / "checkpoints").mkdir(parents=True)
    shutil.copy(world["run"] / "config.json", case / "src" / "config.json")


def _byte_tokenizer(case: pathlib.Path, world: dict) -> None:
    from jaxlm.data.tokenizer import SentencePieceTokenizer

    SentencePieceTokenizer.train(["x"], 260, "byte").save(case / "bytes.model")  # 260 tokens, the run has 300


def FINETUNE(*flags: str) -> tuple[str, ...]:
    """`T` started from {copy} (run.init_from), training 2 steps on the facts corpus, tokenized on the fly."""
    return T("--config.run.init_from={copy}", "--config.data.corpus={corpus}", "--config.data.separator=\n\n",
             "--config.data.tokenize_on_the_fly=true", "--config.run.steps=2", "--config.data.seq_len=64", *flags)


TASKS_SHAPE = '{"context": "alice likes", "choices": [" apples.", " figs."], "answer": 0}\n'
CHAT_ROW = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
SHAREGPT_ROW = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}\n'


def GRPO(*flags: str) -> tuple[str, ...]:
    """`python -m jaxlm.train` with the GRPO recipe from a random model (no SFT stage), writing under the case."""
    return ("--config=configs/grpo_tiny.py", "--config.run.init_from=", "--config.run.output_dir={case}/runs",
            "--config.data.cache_dir={case}/cache", "--config.run.eval_at_start=off", *flags)


def SFT(file: str, *flags: str) -> tuple[str, ...]:
    """`T` on a chat file in the case's directory, rendered with the simple template, no row held out."""
    return T(f"--config.data.corpus={{case}}/{file}", "--config.data.format=chat", "--config.data.chat_template=simple",
             "--config.data.val_fraction=0", *flags)

# ----------------------------------------------------------------------------- the catalogue

CASES = [
    # --- config: keys, values, types (train)
    Case("unknown-key", "train", T("--config.optim.peak_lrr=1e-3"), 2,
         ("unknown config key 'optim.peak_lrr'", "did you mean 'optim.peak_lr'?")),
    Case("unknown-key-alias", "train", T("--config.optim.lr=1e-3"), 2, ("did you mean 'optim.peak_lr'?",), slow=True),
    Case("unknown-section", "train", T("--config.optimizer.lr=1e-3"), 2, ("unknown config key 'optimizer.lr'",
                                                                         "did you mean 'optim'?")),
    Case("not-an-integer", "train", T("--config.model.d_model=wide"), 2, ("--config.model.d_model=wide",
                                                                        "expected an integer"), slow=True),
    Case("not-a-bool", "train", T("--config.model.scan_layers=maybe"), 2, ("expected a bool",), slow=True),
    Case("float-for-integer", "train", T("--config.data.global_batch_size=1.5"), 2, ("global_batch_size",
                                                                                   "expected an integer"), slow=True),
    Case("zero-lr", "train", T("--config.optim.peak_lr=0"), 2, ("config.optim.peak_lr=0.0 is not allowed",
                                                              "a positive number"), slow=True),
    Case("negative-lr", "train", T("--config.optim.peak_lr=-3e-4"), 2, ("config.optim.peak_lr=-0.0003",), slow=True),
    Case("unknown-optimizer", "train", T("--config.optim.name=sgd"), 2,
         ("config.optim.name='sgd' is not allowed", "one of 'adamw', 'muon', 'lion'"), slow=True),
    # any float key, any section: finite (`Section.check_values`); tests/test_sections.py tries every key
    Case("nan-float", "train", T("--config.optim.peak_lr=nan"), 2, ("config.optim.peak_lr=nan is not allowed",
                                                                   "a finite number")),
    Case("inf-float", "train", T("--config.energy.poll_s=inf"), 2, ("config.energy.poll_s=inf is not allowed",
                                                                   "a finite number"), slow=True),
    Case("unknown-variant", "train", T("--config.model.variant=mamba"), 2, ("'mamba' is not allowed", "'llama'")),
    Case("kv-heads-not-divisor", "train", T("--config.model.n_kv_heads=3"), 2, ("n_kv_heads=3",
                                                                              "a divisor of model.n_heads=4")),
    Case("unknown-format", "train", T("--config.data.format=xml"), 2, ("config.data.format='xml' is not allowed",)),
    Case("linked-keys-contradict", "train", T("--config.model.vocab_size=512", "--config.data.tokenizer_vocab_size=1024"),
         2, ("--config.model.vocab_size=512 and --config.data.tokenizer_vocab_size=1024 contradict", "give only one")),
    Case("rows-longer-than-the-context", "train", T("--config.data.seq_len=256", "--config.model.max_seq_len=128"), 2,
         ("config.data.seq_len=256 is not allowed: at most model.max_seq_len=128",), slow=True),
    Case("unknown-flag", "train", T("--steps=10"), 2, ("unrecognised argument '--steps=10'",)),
    Case("bad-xla-flag", "train", T("--config.run.xla_flags=--xla_bogus_flag=1"), 2,
         ("run.xla_flags", "refuses them", "--xla_bogus_flag=1")),
    # --- config: the mesh and the batch against the devices (8 here)
    Case("batch-not-divisible", "train", T("--config.mesh.fsdp=8", "--config.data.global_batch_size=12"), 2,
         ("global_batch_size=12", "does not divide")),
    Case("batch-not-divisible-over-mesh-expert", "train",
         T("--config.mesh.fsdp=4", "--config.mesh.expert=2", "--config.data.global_batch_size=12"), 2,
         ("global_batch_size=12", "does not divide over the 8 devices", "mesh.data=1 x mesh.fsdp=4 x mesh.expert=2"),
         slow=True),
    Case("heads-over-tensor", "train", T("--config.mesh.fsdp=1", "--config.mesh.tensor=8"), 2,
         ("divisible by the tensor axis mesh.tensor=8",)),
    Case("mesh-needs-more-devices", "train", T("--config.mesh.fsdp=3"), 2, ("needs 3 devices but 8 are available",)),
    Case("micro-batches-not-divisor", "train", T("--config.optim.micro_batches=5"), 2,
         ("a divisor of data.global_batch_size=16",)),
    # --- config: pipeline stages against the layers, the micro-batches and the devices
    Case("pipeline-layers-not-divisible", "train",
         T("--config.mesh.stage=4", "--config.pipeline.schedule=circular", "--config.pipeline.repeats=2"), 2,
         ("model.n_layers=4", "mesh.stage x pipeline.repeats = 4 x 2")),
    Case("pipeline-fewer-microbatches-than-stages", "train",
         T("--config.mesh.stage=2", "--config.pipeline.microbatches=1"), 2,
         ("pipeline.microbatches=1", "at least mesh.stage=2")),
    Case("loss-scale-with-float32", "train", T("--config.optim.loss_scale=dynamic", "--config.model.dtype=float32"), 2,
         ("config.optim.loss_scale='dynamic' with config.model.dtype='float32' is not allowed",), slow=True),
    Case("energy-negative-price", "train", T("--config.energy.price_per_device_hour=-2"), 2,
         ("config.energy.price_per_device_hour=-2.0 is not allowed", "0 or more"), slow=True),
    Case("energy-bad-device-watts", "train", T("--config.energy.device_watts=H100"), 2,
         ("config.energy.device_watts='H100'", "kind=watts"), slow=True),
    Case("stage-does-not-divide-devices", "train", T("--config.mesh.stage=3", "--config.model.n_layers=6"), 2,
         ("stage=3", "does not divide the 8 available"), slow=True),
    # --- config: sizes that cannot fit, refused before anything is allocated
    Case("batches-beyond-host-memory", "train", T("--config.data.seq_len=1000000000"), 2,
         ("input batches alone need", "host memory", "data.seq_len")),
    Case("model-beyond-device-memory", "train", T("--config.data.seq_len=100000", "--config.data.global_batch_size=8"),
         2, ("per device (the planner's estimate)", "python -m jaxlm.plan")),
    # --- recipe files
    Case("missing-recipe", "train", ("--config=configs/nope.py",), 2, ("no recipe file 'configs/nope.py'", "tiny")),
    Case("recipe-syntax-error", "train", ("--config={case}/recipe.py",), 2, ("recipe.py:2", "SyntaxError"),
         setup=_recipe("def get_config():\n    return (\n")),
    Case("recipe-name-error", "train", ("--config={case}/recipe.py",), 2, ("recipe.py:3", "NameError", "undefined"),
         setup=_recipe("def get_config():\n    pass\nundefined_name\n"), slow=True),
    Case("recipe-returns-no-config", "train", ("--config={case}/recipe.py",), 2,
         ("get_config() returned a int, not a ConfigDict",), setup=_recipe("def get_config():\n    return 3\n"), slow=True),
    Case("recipe-without-get-config", "train", ("--config={case}/recipe.py",), 2, ("defines no get_config()",),
         setup=_recipe("CONFIG = 1\n")),
    Case("experiment-syntax-error", "experiment", ("{case}/exp.py",), 2, ("exp.py:2", "SyntaxError"),
         setup=_write("exp.py", "import os\nEXPERIMENT = Experiment(\n"), slow=True),
    Case("experiment-name-error", "experiment", ("{case}/exp.py",), 2, ("exp.py:1", "NameError", "'Experiment'"),
         setup=_write("exp.py", 'EXPERIMENT = Experiment(name="x")\n'), slow=True),
    Case("experiment-missing", "experiment", ("{case}/nope.py",), 2, ("nope.py' does not exist",)),
    # --- data (train)
    Case("corpus-glob-matches-nothing", "train", T("--config.data.corpus={case}/missing/*.jsonl"), 2,
         ("no input files match",), unchanged="{case}"),
    Case("corpus-bad-jsonl", "train", T("--config.data.corpus={case}/bad.jsonl"), 2, ("bad.jsonl:2: not valid JSON",),
         setup=_write("bad.jsonl", '{"text": "fine"}\n{"text": "broken\n')),
    Case("corpus-no-text-field", "train", T("--config.data.corpus={case}/x.jsonl"), 2, ("x.jsonl:1", "'text'"),
         setup=_write("x.jsonl", '{"body": "no text field here"}\n'), slow=True),
    Case("corpus-empty", "train", T("--config.data.corpus={case}/empty.txt"), 2, ("holds no training documents",),
         setup=_write("empty.txt", "")),
    Case("corpus-gzip-corrupt", "train", T("--config.data.corpus={case}/z.jsonl.gz"), 2, ("truncated or corrupt",),
         setup=_write("z.jsonl.gz", "not gzip at all")),
    Case("mixture-weights-sum-to-zero", "train", T("--config.data.sources=a={case}/a.txt:0,b=builtin:0"), 2,
         ("config.data.sources=", "the weights sum to 0")),
    Case("mixture-source-missing", "train", T("--config.data.sources=a={case}/missing/*.jsonl:2,b=builtin"), 2,
         ("data.sources: source 'a': no input files match", "missing/*.jsonl"), unchanged="{case}"),
    Case("mixture-stage-names-no-source", "train", T("--config.data.sources=a=builtin,b=builtin",
                                                      "--config.data.stages=100:c=1"), 2,
         ("config.data.stages='100:c=1'", "names the source 'c', which data.sources does not (a, b)"), slow=True),
    Case("mixture-stage-beyond-the-run", "train", T("--config.data.sources=a=builtin,b=builtin",
                                                     "--config.data.stages=400:a=1"), 2,
         ("config.data.stages='400:a=1'", "step 400 is beyond run.steps=300"), slow=True),
    Case("tokenizer-missing", "train", T("--config.data.tokenizer_path={case}/nope.model"), 2,
         ("tokenizer model not found", "nope.model")),
    Case("tokenizer-not-a-model", "train", T("--config.data.tokenizer_path={case}/junk.model"), 2,
         ("not a SentencePiece model", "junk.model"), setup=_write("junk.model", "junk")),
    Case("tokenizer-json-not-a-tokenizer", "train", T("--config.data.tokenizer_path={case}/hf"), 2,
         ("hf/tokenizer.json is JSON but not a Hugging Face tokenizer.json",),
         setup=_write("hf/tokenizer.json", '{"model_type": "llama", "vocab_size": 32000}'), slow=True),
    Case("tokenizer-vocab-too-large", "train", T("--config.data.tokenizer_path={tok}", "--config.model.vocab_size=256"), 2,
         ("has 300 tokens but config.model.vocab_size=256", "set config.model.vocab_size=300")),
    Case("prepared-corpus-on-the-fly", "train",
         T("--config.data.corpus={prepared}", "--config.data.tokenize_on_the_fly=true"), 2,
         ("is a prepared (tokenized) corpus", "tokenize_on_the_fly=false"), unchanged="{prepared}"),
    Case("prepared-shard-damaged", "train",
         T("--config.data.corpus={case}/prepared", "--config.model.vocab_size=300"), 2,
         ("train-00000.tokens is truncated", "re-run prepare"), setup=_copy_prepared(_truncate_shards)),
    Case("prepared-every-shard-skipped", "train",
         T("--config.data.corpus={case}/prepared", "--config.model.vocab_size=300",
           "--config.data.on_damaged_shard=skip"), 2, ("every train shard", "is damaged"),
         setup=_copy_prepared(_truncate_shards), slow=True),
    Case("prepared-unfinished", "train", T("--config.data.corpus={case}/prepared", "--config.model.vocab_size=300"), 2,
         ("prepare did not finish",), setup=_copy_prepared(_unfinished)),
    Case("prepared-manifest-corrupt", "train",
         T("--config.data.corpus={case}/prepared", "--config.model.vocab_size=300"), 2, ("is corrupt",),
         setup=_copy_prepared(lambda p: (p / "manifest.json").write_text("{not json")), slow=True),
    # --- SFT data (train, prepare, evaluate): each stops before a tokenizer is trained or a model loaded
    Case("sft-new-tokenizer-no-template", "train", T("--config.data.corpus=builtin_chat"), 2,
         ("a tokenizer trained here has no chat template", "set data.chat_template")),
    # GRPO (docs/post-training.md): a reward that does not import or raises, a prompt row without a field
    Case("grpo-reward-does-not-import", "train", GRPO("--config.grpo.rewards=exact_match,no_such_rewards_mod:score"), 2,
         ("reward 'no_such_rewards_mod:score'", "does not import", "PYTHONPATH")),
    Case("grpo-reward-raises", "train", GRPO("--config.grpo.rewards={case}/r.py:score"), 2,
         ("reward '", "r.py:score' raised ZeroDivisionError", "on completion #0", "fix the function"),
         setup=_write("r.py", "def score(prompt, completion, answer):\n    return 1 / 0\n"), slow=True),
    Case("grpo-prompt-without-answer", "train", GRPO("--config.data.corpus={case}/p.jsonl"), 2,
         ("p.jsonl:2", "no field 'answer'", '"answer": str'),
         setup=_write("p.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')),
    Case("sft-row-without-messages", "train", SFT("chat.jsonl"), 2, ("chat.jsonl:2", "no field 'messages'"),
         setup=_write("chat.jsonl", CHAT_ROW + '{"text": "a text row"}\n')),
    Case("sft-role-the-template-rejects", "train", SFT("chat.jsonl"), 2,
         ("chat.jsonl:1", "chat template 'simple' refuses it", "not tool"),
         setup=_write("chat.jsonl", CHAT_ROW.replace('"user"', '"tool"')), slow=True),
    Case("sft-empty-assistant-turn", "train", SFT("chat.jsonl"), 2, ("chat.jsonl:1", "message 2 (assistant) is empty"),
         setup=_write("chat.jsonl", CHAT_ROW.replace('"hello"', '""')), slow=True),
    Case("sft-template-file-missing", "train", SFT("chat.jsonl", "--config.data.chat_template={case}/none.jinja"), 2,
         ("none.jinja", "neither a built-in template"), setup=_write("chat.jsonl", CHAT_ROW)),
    Case("sft-template-raises", "train", SFT("chat.jsonl", "--config.data.chat_template={case}/bad.jinja"), 2,
         ("bad.jinja failed rendering it", "ZeroDivisionError", "fix the chat template"),
         setup=lambda c, w: (_write("chat.jsonl", CHAT_ROW)(c, w), _write("bad.jinja", "{{ 1 // 0 }}")(c, w))),
    Case("sft-template-unknown", "train", T("--config.data.corpus=builtin_chat", "--config.data.chat_template=llama"),
         2, ("config.data.chat_template='llama' is not allowed", "chatml, simple or a .jinja file"), slow=True),
    Case("sft-format-on-the-builtin-corpus", "train", T("--config.data.format=chat"), 2,
         ("config.data.corpus='builtin' is not allowed", "builtin_chat")),
    Case("prepare-chat-tokenizer-without-template", "data.prepare",
         ("--input=builtin_chat", "--format=chat", "--tokenizer={tok}", "--output={case}/o"), 2,
         ("this tokenizer has no chat template", "--chat_template")),
    Case("eval-chat-file-bad-row", "evaluate",
         ("--run_dir={run}", "--corpus={case}/chat.jsonl", "--format=chat", "--chat_template=simple"), 2,
         ("chat.jsonl:2", "not valid JSON"), setup=_write("chat.jsonl", CHAT_ROW + '{"messages": [\n')),
    Case("sft-messages-without-format-chat", "train", T("--config.data.corpus={case}/chat.jsonl"), 2,
         ("chat.jsonl:1", "no field 'text' (found: messages)", "data.format=chat"), setup=_write("chat.jsonl", CHAT_ROW),
         slow=True),
    # prepared into data.cache_dir with a given tokenizer: the bad row stops the preparation, which leaves nothing
    Case("sft-sharegpt-unknown-role", "train", SFT("chat.jsonl", "--config.data.tokenizer_path={tok}"), 2,
         ("chat.jsonl:2", "message 2 is from 'observation'", "no ShareGPT role"),
         setup=_write("chat.jsonl", SHAREGPT_ROW + SHAREGPT_ROW.replace('"gpt"', '"observation"')),
         unchanged="{case}/cache", no_progress_bar=True),
    Case("sft-alpaca-without-output", "train", SFT("chat.jsonl", "--config.data.tokenizer_path={tok}"), 2,
         ("chat.jsonl:1", "no field 'output'", "data.format=alpaca"),
         setup=_write("chat.jsonl", '{"instruction": "Say hi", "input": ""}\n'), unchanged="{case}/cache",
         no_progress_bar=True),
    # --- the run directory (train)
    Case("output-dir-is-a-file", "train", T("--config.run.output_dir={case}/afile"), 2,
         ("config.run.output_dir=", "afile' is a file; give a directory"), setup=_write("afile", "x")),
    Case("output-dir-uncreatable", "train", T("--config.run.output_dir=/proc/jaxlm-cannot-be-here"), 2,
         ("cannot lock the run directory", "config.run.output_dir")),
    Case("run-dir-in-use", "train", FACTS(), 2, ("is in use by another run", f"pid {os.getpid()}"),
         setup=lambda case, world: RunLock(_copy_run(case, world)).acquire(),  # held by this process
         unchanged="{copy}"),
    Case("resume-with-another-model", "train", FACTS("--config.model.d_model=96"), 2,
         ("was trained with another config", "model.d_model: 64 -> 96"), setup=lambda c, w: _copy_run(c, w),
         unchanged="{copy}"),
    Case("resume-with-another-lr", "train", FACTS("--config.optim.peak_lr=1e-4"), 2,
         ("optim.peak_lr: 0.003 -> 0.0001",), setup=lambda c, w: _copy_run(c, w), unchanged="{copy}"),
    Case("resume-newer-layout", "train", FACTS(), 2, ("layout 99", "this jaxlm"), setup=_layout_everywhere(99),
         unchanged="{copy}", slow=True),
    Case("resume-every-checkpoint-damaged", "train", FACTS("--config.run.steps=60"), 2,
         ("could be restored", "step 40", "step 20", "config.run.fresh=true"), setup=_damage_checkpoints(20, 40),
         unchanged="{copy}"),
    # --- Hugging Face checkpoints in and out (jaxlm.hf); tests/test_hf.py has the cases that need real weights
    Case("hf-import-not-a-directory", "hf", ("import", "--hf_dir={case}/nope", "--output={case}/out"), 2,
         ("--hf_dir=", "nope' does not exist")),
    Case("hf-import-unknown-architecture", "hf", ("import", "--hf_dir={case}/hf", "--output={case}/out"), 2,
         ('config.json: model_type="mamba"', "jaxlm imports llama, mistral, qwen2, qwen3, gpt2"),
         setup=_write("hf/config.json", '{"model_type": "mamba", "vocab_size": 300}')),
    Case("hf-import-value-jaxlm-refuses", "hf", ("import", "--hf_dir={case}/hf", "--output={case}/out"), 2,
         ("config.json: num_key_value_heads=3 is not allowed", "a divisor of num_attention_heads=4"),
         setup=_write("hf/config.json", HF_LLAMA[:-1] + ', "num_key_value_heads": 3}'), slow=True),
    Case("hf-import-pickles-only", "hf", ("import", "--hf_dir={case}/hf", "--output={case}/out"), 2,
         ("holds only PyTorch pickle files (pytorch_model.bin)", "safetensors only", "save_pretrained"),
         setup=lambda c, w: (_write("hf/config.json", HF_LLAMA)(c, w), _write("hf/pytorch_model.bin", "not read")(c, w))),
    Case("hf-import-missing-shard", "hf", ("import", "--hf_dir={case}/hf", "--output={case}/out"), 2,
         ("model-00001-of-00002.safetensors is missing", "download it again"),
         setup=lambda c, w: (_write("hf/config.json", HF_LLAMA)(c, w), _write(
             "hf/model.safetensors.index.json",
             '{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}')(c, w)), slow=True),
    # an import computes what the source computes, or is refused
    Case("eval-a-hugging-face-directory", "evaluate", ("--run_dir={case}/exported",), 2,
         ("is a Hugging Face model directory, not a jaxlm run", "python -m jaxlm.hf import --hf_dir="),
         setup=_exported, slow=True),
    Case("hf-import-tied-but-head-differs", "hf", ("import", "--hf_dir={case}/exported", "--output={case}/out"), 2,
         ("ties the output layer to the embedding", "differs from model.embed_tokens.weight",
          '"tie_word_embeddings": false'), setup=_exported_tied, slow=True),
    Case("hf-import-nan-weight", "hf", ("import", "--hf_dir={case}/exported", "--output={case}/out"), 2,
         ("tensor model.norm.weight holds nan or inf values",), setup=_exported_nan, slow=True),
    Case("hf-import-not-json", "hf", ("import", "--hf_dir={case}/hf", "--output={case}/out"), 2,
         ("config.json is not valid JSON",), setup=_write("hf/config.json", "model_type: llama"), slow=True),
    Case("hf-export-peft-without-adapters", "hf", ("export", "--run_dir={copy}", "--output={case}/out",
                                                   "--adapters=peft"), 2,
         ("has no LoRA adapters (lora.rank=0)", "--adapters=peft exports a run trained with them"),
         setup=lambda c, w: _copy_run(c, w), unchanged="{copy}"),
    Case("hf-export-with-base-merged", "hf", ("export", "--run_dir={run}", "--output={case}/out", "--with_base"), 2,
         ("--with_base is for an adapter export: add --adapters=peft",), slow=True),
    Case("hf-export-output-taken", "hf", ("export", "--run_dir={run}", "--output={case}/taken"), 2,
         ("--output=", "taken exists and is not empty", "give a new directory"), setup=_write("taken/mine.txt", "kept"),
         unchanged="{case}/taken"),
    # a disk that fills during an export or an import: one line, and nothing left in the way of the same command
    # (`run_dir.new_output` writes a hidden sibling and renames it when complete)
    Case("hf-export-disk-full", "hf", ("export", "--run_dir={run}", "--output={case}/out"), 74,
         ("past the size limit",), file_size_limit=200_000, then="resumes", slow=True),
    Case("hf-import-disk-full", "hf", ("import", "--hf_dir={case}/exported", "--output={case}/out"), 74,
         # past the run's config.json (about 5 kB with every section) and below the checkpoint's arrays
         ("checkpoints/0 failed", "File too large"), setup=_exported, file_size_limit=8_000, then="resumes",
         slow=True),
    # --- what a command may write: only its own kind of directory or file (jaxlm.run_dir's checks)
    Case("train-into-a-foreign-directory", "train", T("--config.run.name=hfmodel"), 2,
         ("hfmodel (run.output_dir/run.name) holds files jaxlm did not write", "choose another config.run.name"),
         setup=_write("runs/hfmodel/config.json", '{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'),
         unchanged="{case}/runs/hfmodel"),
    Case("hf-import-into-a-run", "hf", ("import", "--hf_dir={case}/src", "--output={copy}/checkpoints/99"), 2,
         ("checkpoints/99' is inside the checkpoints of", "facts (only training writes there)", "outside them"),
         setup=lambda c, w: (_copy_run(c, w), (c / "src").mkdir()), unchanged="{copy}"),
    Case("compress-output-inside-a-run", "compress", ("--run_dir={run}", "--output={copy}/int8",
                                                      "--config.compress.quantize=int8"), 2,
         ("int8 is inside the run directory",), setup=lambda c, w: _copy_run(c, w), unchanged="{copy}", slow=True),
    Case("eval-output-over-another-file", "evaluate", ("--run_dir={run}", "--output={case}/mine.json"), 2,
         ("mine.json exists and is not an earlier result", "left as it is"), setup=_write("mine.json", '{"mine": 1}'),
         unchanged="{case}"),
    Case("eval-output-into-a-checkpoint", "evaluate",
         ("--run_dir={run}", "--output={copy}/checkpoints/20/jaxlm_manifest.json"), 2,
         ("is inside the checkpoints of",), setup=lambda c, w: _copy_run(c, w), unchanged="{copy}", slow=True),
    # a run whose results file cannot be written (read-only, or its name taken): the results are printed, exit 0
    Case("eval-results-unwritable-still-printed", "evaluate", ("--run_dir={copy}", "--corpus={corpus}"), 0,
         ("the results were not written", "give --output=FILE"),
         setup=lambda c, w: (_copy_run(c, w), (c / "facts" / "eval-40.json").mkdir())),
    # --- compressing a trained run (python -m jaxlm.compress)
    # a group that does not divide a width ends with a short group (jaxlm.quant); an odd one cannot pack 4 bits
    Case("compress-group-odd", "compress", ("--run_dir={run}", "--output={case}/out",
                                            "--config.compress.quantize=int4", "--config.compress.group=47"),
         2, ("config.compress.group=47", "a group of 47 values is odd", "use an even group")),
    Case("compress-bit-width-unknown", "compress", ("--run_dir={run}", "--output={case}/out",
                                                    "--config.compress.quantize=int5"), 2,
         ("config.compress.quantize='int5' is not allowed", "int8, int4, int3")),
    Case("compress-sparsity-out-of-range", "compress", ("--run_dir={run}", "--output={case}/out",
                                                        "--config.compress.sparsity=1.0"), 2,
         ("config.compress.sparsity=1.0 is not allowed", "a fraction in [0, 1)")),
    Case("compress-output-taken", "compress", ("--run_dir={run}", "--output={case}/taken",
                                               "--config.compress.quantize=int8"), 2,
         ("--output=", "taken exists and is not empty"), setup=_write("taken/mine.txt", "kept"),
         unchanged="{case}/taken"),
    Case("compress-sparsity-without-schedule", "train", T("--config.compress.sparsity=0.5"), 2,
         ("config.compress.sparsity=0.5 on a new run would prune nothing", "set config.compress.prune_end"), slow=True),
    # --- fine-tuning: a new run from another run's parameters (run.init_from), the shared run as the source
    Case("init-from-not-a-directory", "train", T("--config.run.init_from={case}/nope"), 2,
         ("config.run.init_from=", "nope is not a directory", "give a run directory")),
    Case("init-from-not-a-run", "train", T("--config.run.init_from={case}"), 2,
         ("is not a run directory (no config.json)",), slow=True),
    Case("init-from-no-checkpoint", "train", T("--config.run.init_from={case}/src"), 2,
         ("has no complete checkpoint", "train it first"), setup=_untrained_source, slow=True),
    Case("init-from-step-missing", "train", T("--config.run.init_from={run}", "--config.run.init_step=30"), 2,
         ("config.run.init_step=30", "no complete checkpoint for that step", "20, 40"), unchanged="{run}", slow=True),
    Case("init-from-own-directory", "train", FACTS("--config.run.init_from={copy}"), 2,
         ("is this run's own directory", "config.run.name"), setup=lambda c, w: _copy_run(c, w), unchanged="{copy}"),
    Case("init-from-contradicting-flag", "train", T("--config.run.init_from={run}", "--config.model.n_layers=6"), 2,
         ("--config.model.n_layers=6 contradicts", "model.n_layers is 2", "drop --config.model.n_layers"),
         unchanged="{run}"),
    Case("init-from-tokenizer-vocab", "train",
         T("--config.run.init_from={run}", "--config.data.tokenizer_path={case}/bytes.model"), 2,
         ("has 260 tokens", "vocab_size=300", "leave data.tokenizer_path empty"), setup=_byte_tokenizer),
    Case("init-from-every-checkpoint-damaged", "train", FINETUNE(), 2,
         ("config.run.init_from=", "could be restored", "step 40", "step 20"), setup=_damage_checkpoints(20, 40),
         unchanged="{copy}"),
    Case("init-from-newest-damaged", "train", FINETUNE(), 0, ("checkpoints/40 could not be restored", "trying step 20"),
         setup=_damage_checkpoints(40), unchanged="{copy}", one_device=True, slow=True),
    # --- distillation (objective.name=distill): the shared run as the teacher
    Case("distill-teacher-missing", "train",
         T("--config.objective.name=distill", "--config.distill.teacher={case}/nope"), 2,
         ("config.distill.teacher=", "nope")),
    Case("distill-teacher-other-tokenizer", "train",
         FINETUNE("--config.objective.name=distill", "--config.distill.teacher={run}", "--config.run.init_from=",
                  "--config.data.tokenizer_path={case}/bytes.model", "--config.model.vocab_size=300"), 2,
         ("the teacher's tokenizer is not the student's", "260 tokens", "300 tokens", "bytes.model"),
         setup=_byte_tokenizer, unchanged="{run}", slow=True),
    # --- multi-process flags
    Case("process-id-out-of-range", "train",
         T("--coordinator=localhost:1234", "--num_processes=2", "--process_id=5"), 2, ("the id must be in 0..1",)),
    Case("coordinator-not-host-port", "train", T("--coordinator=nohost", "--num_processes=2", "--process_id=0"), 2,
         ("'nohost' is not host:port",)),
    Case("num-processes-not-a-number", "train", T("--num_processes=two"), 2, ("--num_processes=two", "expected"), slow=True),
    Case("flag-without-value", "train", T("--coordinator"), 2, ("--coordinator needs a value",), slow=True),
    Case("launcher-env-not-a-number", "train", T(), 2, ("SLURM_NTASKS", "not an integer"),
         env=(("SLURM_NTASKS", "many"), ("SLURM_PROCID", "0"), ("SLURM_STEP_NODELIST", "node1"))),
    # --- the machine: XLA:CPU as on an x86 processor without F16C, where it compiles no float16 (jaxlib 0.10)
    *([Case("float16-on-a-cpu-without-f16c", "train", T("--config.model.dtype=float16"), 2,
            ("model.dtype='float16'", "F16C", "bfloat16"), env=(("XLA_FLAGS", "--xla_cpu_max_isa=SSE4_2"),),
            one_device=True)] if platform.machine().lower() in ("x86_64", "amd64") else []),
    # --- checkpoints, through evaluate and generate
    Case("eval-run-dir-missing", "evaluate", ("--run_dir={case}/nope",), 2, ("does not exist", "--run_dir")),
    Case("eval-not-a-run-dir", "evaluate", ("--run_dir={case}",), 2, ("is not a run directory (no config.json)",),
         slow=True),
    Case("eval-config-not-json", "evaluate", ("--run_dir={copy}",), 2, ("config.json is not valid JSON",),
         setup=_replace_run_file("config.json", "{"), unchanged="{copy}"),
    Case("eval-config-edited", "evaluate", ("--run_dir={copy}",), 2,
         ("config.json disagrees with checkpoint 40", "model.d_model: 64 -> 96"),
         setup=_edit_json("config.json", _model_edit("d_model", 96)), unchanged="{copy}"),
    Case("eval-no-checkpoints", "evaluate", ("--run_dir={copy}",), 2, ("has no checkpoints",),
         setup=_remove("checkpoints"), unchanged="{copy}", slow=True),
    Case("eval-no-tokenizer", "evaluate", ("--run_dir={copy}",), 2,
         ("has no tokenizer (tokenizer.json or tokenizer.model)",), setup=_remove("tokenizer.model"), unchanged="{copy}"),
    Case("eval-step-missing", "evaluate", ("--run_dir={run}", "--step=999"), 2,
         ("--step=999", "no complete checkpoint for that step", "20, 40"), unchanged="{run}", slow=True),
    Case("eval-newest-damaged", "evaluate", ("--run_dir={copy}", "--corpus={corpus}", "--output={case}/e.json"), 0,
         ("checkpoints/40 could not be restored", "CRC-32", "trying step 20"), setup=_damage_checkpoints(40), slow=True),
    Case("eval-newest-truncated", "evaluate", ("--run_dir={copy}", "--corpus={corpus}", "--output={case}/e.json"), 0,
         ("checkpoints/40 could not be restored", "bytes", "when saved"), setup=_damage_checkpoints(40, how="truncate")),
    Case("eval-every-checkpoint-damaged", "evaluate", ("--run_dir={copy}",), 2,
         ("could be restored", "step 40", "step 20"), setup=_damage_checkpoints(20, 40), unchanged="{copy}"),
    Case("eval-newer-layout", "evaluate", ("--run_dir={copy}",), 2, ("layout 99",), setup=_layout_everywhere(99),
         unchanged="{copy}", slow=True),
    Case("eval-max-tokens-negative", "evaluate", ("--run_dir={run}", "--max_tokens=-1"), 2,
         ("--max_tokens=-1", "0 (all) or more"), slow=True),
    Case("eval-unknown-split", "evaluate", ("--run_dir={run}", "--corpus={prepared}", "--split=test"), 2,
         ("--split=test", "use one of")),
    Case("eval-corpus-empty", "evaluate", ("--run_dir={run}", "--corpus={case}/empty.txt"), 2, ("no documents",),
         setup=_write("empty.txt", "")),
    Case("eval-seq-len-too-long", "evaluate", ("--run_dir={run}", "--corpus={corpus}", "--seq_len=100000"), 2,
         ("--seq_len=100000", "longer than the model's context"), slow=True),
    Case("eval-lm-eval-setting-without-tasks", "evaluate", ("--run_dir={run}", "--corpus=none", "--lm_eval_limit=5"), 2,
         ("--lm_eval_limit is a setting of --lm_eval_tasks",), slow=True),
    Case("eval-lm-eval-unknown-task", "evaluate", ("--run_dir={run}", "--corpus=none", "--lm_eval_tasks=no_such_task"), 2,
         ("no lm-evaluation-harness task 'no_such_task'",), slow=True),
    Case("eval-tasks-missing", "evaluate", ("--run_dir={run}", "--corpus=none", "--tasks={case}/t.jsonl"), 2,
         ("--tasks: no file",)),
    Case("eval-tasks-not-json", "evaluate", ("--run_dir={run}", "--corpus=none", "--tasks={case}/t.jsonl"), 2,
         ("t.jsonl:1", "not JSON"), setup=_write("t.jsonl", "{oops\n"), slow=True),
    Case("eval-tasks-no-choices", "evaluate", ("--run_dir={run}", "--corpus=none", "--tasks={case}/t.jsonl"), 2,
         ("no 'choices'",), setup=_write("t.jsonl", '{"context": "x", "answer": 0}\n')),
    Case("eval-tasks-answer-out-of-range", "evaluate", ("--run_dir={run}", "--corpus=none", "--tasks={case}/t.jsonl"),
         2, ("'answer' must be the index",), setup=_write("t.jsonl", TASKS_SHAPE.replace('"answer": 0', '"answer": 5')),
         slow=True),
    Case("eval-output-unwritable", "evaluate",
         ("--run_dir={run}", "--corpus={corpus}", "--output={case}/afile/out.json"), 2,
         ("--output=", "afile is a file, so nothing can be written under it"), setup=_write("afile", "x"),
         unchanged="{run}"),
    Case("eval-dtype", "evaluate", ("--run_dir={run}", "--dtype=float64"), 2, ("--dtype=float64",)),
    Case("eval-unknown-flag", "evaluate", ("--run_dir={run}", "--steps=3"), 2, ("unrecognized arguments: --steps=3",),
         slow=True),
    Case("generate-no-prompt", "generate", ("--run_dir={run}",), 2, ("give at least one --prompt",)),
    Case("generate-no-samples", "generate", ("--run_dir={run}", "--prompt=alice", "--num_samples=0"), 2,
         ("--num_samples=0",), slow=True),
    Case("generate-negative-temperature", "generate", ("--run_dir={run}", "--prompt=a", "--temperature=-1"), 2,
         ("--temperature=-1.0",)),
    Case("generate-top-p-zero", "generate", ("--run_dir={run}", "--prompt=a", "--top_p=0"), 2, ("--top_p=0.0",), slow=True),
    Case("generate-top-k-negative", "generate", ("--run_dir={run}", "--prompt=a", "--top_k=-2"), 2, ("--top_k=-2",),
         slow=True),
    Case("generate-no-new-tokens", "generate", ("--run_dir={run}", "--prompt=a", "--max_new_tokens=0"), 2,
         ("--max_new_tokens=0",)),
    Case("generate-prompts-file-not-utf8", "generate", ("--run_dir={run}", "--prompts_file={case}/p.txt"), 2,
         ("p.txt is not UTF-8 text",), setup=lambda c, w: (c / "p.txt").write_bytes(b"\xff\xfe bad\n"), slow=True),
    # --- chat in generation ({run} has no chat template: trained on text, a tokenizer trained here); braces
    # in the arguments are doubled (the placeholders are filled by str.format)
    Case("generate-chat-bad-json", "generate", ("--run_dir={run}", '--messages=[{{"role": "user"'), 2,
         ("--messages #1: not JSON", "give a list of")),
    Case("generate-chat-unknown-role", "generate", ("--run_dir={run}", '--messages=[{{"role": "bot", "content": "hi"}}]'),
         2, ("--messages #1: message 1 has role 'bot'", "use one of system, user, assistant"), slow=True),
    Case("generate-chat-ends-with-assistant", "generate",
         ("--run_dir={run}", '--messages=[{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "yo"}}]'),
         2, ("the last message is the assistant's",), slow=True),
    Case("generate-chat-jsonl-bad-line", "generate", ("--run_dir={run}", "--prompts_file={case}/p.jsonl"), 2,
         ("p.jsonl:3: not JSON",),
         setup=_write("p.jsonl", '[{"role": "user", "content": "hi"}]\n\n{"messages": [{"role": "user", "content"\n'),
         slow=True),
    Case("generate-chat-no-template", "generate", ("--run_dir={run}", "--chat", "--prompt=hi"), 2,
         ("has no chat template", "data.format=chat"), unchanged="{run}"),
    # refused from the run's config and tokenizer before its checkpoint loads: a run holding none says the same
    Case("generate-chat-no-template-before-loading", "generate", ("--run_dir={case}/r", "--chat", "--prompt=hi"), 2,
         ("has no chat template", "data.format=chat"),
         setup=lambda c, w: [(c / "r").mkdir(), *(shutil.copy(w["run"] / n, c / "r" / n)
                                                   for n in ("config.json", "tokenizer.model"))], slow=True),
    Case("generate-interactive-with-prompt", "generate", ("--run_dir={run}", "--interactive", "--prompt=hi"), 2,
         ("--interactive reads the conversation from standard input",), slow=True),
    Case("backend-unknown", "train", T(), 74, ("Unable to initialize backend 'nosuch'", "jaxlm.doctor"),
         env=(("JAX_PLATFORMS", "nosuch"),)),
    Case("generate-prompts-file-missing", "generate", ("--run_dir={run}", "--prompts_file={case}/p.txt"), 2,
         ("--prompts_file=", "p.txt' does not exist")),
    Case("generate-param-dtype", "generate", ("--run_dir={run}", "--prompt=a", "--param_dtype=float64"), 2,
         ("--param_dtype=float64", "use one of")),
    Case("generate-newest-damaged", "generate",
         ("--run_dir={copy}", "--prompt=alice likes", "--max_new_tokens=2", "--temperature=0"), 0,
         ("checkpoints/40 could not be restored", "trying step 20"), setup=_damage_checkpoints(40)),
    # --- prepare and the tokenizer command
    Case("prepare-input-missing", "data.prepare", ("--input={case}/none.txt", "--tokenizer={tok}",
                                                   "--output={case}/out"), 2, ("none.txt",)),
    Case("prepare-tokenizer-missing", "data.prepare", ("--input={corpus}", "--tokenizer={case}/t.model",
                                                       "--output={case}/out"), 2,
         ("--tokenizer=", "t.model' does not exist")),
    Case("prepare-output-foreign", "data.prepare", ("--input={corpus}", "--tokenizer={tok}", "--output={case}/mine"),
         2, ("is not an empty directory", "--output"), setup=_write("mine/notes.txt", "keep me"), unchanged="{case}",
         slow=True),
    Case("prepare-val-fraction", "data.prepare", ("--input={corpus}", "--tokenizer={tok}", "--output={case}/o",
                                                  "--val_fraction=1"), 2, ("val_fraction must be in [0, 1)",), slow=True),
    Case("prepare-shard-docs", "data.prepare", ("--input={corpus}", "--tokenizer={tok}", "--output={case}/o",
                                                "--shard_docs=0"), 2,
         ("--shard_docs=0 is not allowed: at least 1",), slow=True),
    Case("prepare-output-is-a-file", "data.prepare", ("--input={corpus}", "--tokenizer={tok}",
                                                      "--output={case}/afile"), (2, 74), ("afile",),
         setup=_write("afile", "x")),
    Case("tokenizer-train-input-missing", "data.tokenizer", ("train", "--input={case}/none/*.txt",
                                                             "--output={case}/t.model", "--vocab_size=300"), 2,
         ("no input files match",)),
    Case("tokenizer-vocab-too-small", "data.tokenizer", ("train", "--input={corpus}", "--output={case}/t.model",
                                                         "--vocab_size=3"), 2, ("needs vocab_size >", "got 3")),
    Case("tokenizer-encode-missing-model", "data.tokenizer", ("encode", "--model={case}/t.model", "hi"), 2,
         ("--model=", "t.model' does not exist")),
    Case("tokenizer-encode-junk-model", "data.tokenizer", ("encode", "--model={case}/a.txt", "hi"), 2,
         ("not a SentencePiece model", "a.txt"), setup=_write("a.txt", "hello world"), slow=True),
    Case("tokenizer-encode-truncated-json", "data.tokenizer", ("encode", "--model={case}/t.json", "hi"), 2,
         ("t.json is not a Hugging Face tokenizer.json: invalid JSON at line 1",),
         setup=_write("t.json", '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0'), slow=True),
    Case("tokenizer-decode-out-of-range", "data.tokenizer", ("decode", "--model={tok}", "99999"), 2,
         ("token id 99999 is outside",)),
    # --- the planner
    Case("plan-no-devices", "plan", ("--config=configs/tiny.py", "--devices=0"), 2, ("--devices=0",)),
    Case("plan-negative-memory", "plan", ("--config=configs/tiny.py", "--devices=8", "--device_memory_gib=-1"), 2,
         ("--device_memory_gib=-1",), slow=True),
    Case("plan-energy-unknown-device", "plan", ("--config=configs/tiny.py", "--devices=8",
                                                "--config.energy.device=Z80"), 2,
         ("config.energy.device='Z80' is not in the power table", "energy.device_watts='Z80=<watts>'"), slow=True),
    Case("plan-missing-recipe", "plan", ("--config=configs/nope.py", "--devices=8"), 2, ("no recipe file",)),
    Case("plan-bad-value", "plan", ("--config=configs/tiny.py", "--devices=8", "--config.model.d_model=wide"), 2,
         ("expected an integer",), slow=True),
    # --- interrupts: one line, the right code, and the same command then finishes (slow: they train)
    Case("interrupt-tokenizer-training", "train", T(), 130, ("interrupted", "run the same command"),
         signal_after=("SIGINT", "jaxlm: training a"), then="resumes", one_device=True, slow=True),
    Case("terminate-preparation", "train", T(), 75, ("stopped by SIGTERM", "run the same command"),
         signal_after=("SIGTERM", "jaxlm: preparing"), then="resumes", one_device=True, slow=True),
    Case("interrupt-at-start", "train", FACTS("--config.run.steps=60"), (75, 130), ("run the same command",),
         setup=lambda c, w: _copy_run(c, w), signal_after=("SIGINT", "jaxlm: run directory"), then="resumes",
         one_device=True, slow=True),
    Case("prepare-interrupted", "data.prepare", ("--input=builtin", "--tokenizer={tok}", "--output={case}/o",
                                                 "--shard_docs=64"), 130, ("interrupted",),
         # at its first progress line: a fixed delay raced the whole preparation (under 2 s on a quiet machine)
         signal_after=("SIGINT", "stderr:prepare: "), then="resumes", slow=True),
    Case("evaluate-interrupted", "evaluate", ("--run_dir={run}", "--corpus=builtin", "--max_tokens=0"), 130,
         ("interrupted", "run the same command again"), signal_after=("SIGINT", ""), signal_delay=4.0, unchanged="{run}",
         slow=True),
    Case("disk-full-at-the-first-save", "train", FACTS(), 74, ("saving checkpoint", "failed", "File too large",
                                                               "newest complete checkpoint is none"),
         file_size_limit=60_000, one_device=True, slow=True),
    Case("resume-past-a-damaged-checkpoint", "train", FACTS("--config.run.steps=40"), 0,
         ("checkpoints/40 could not be restored",), setup=_damage_checkpoints(40), one_device=True, slow=True),
]

# Variants of a default case above (the same check reached another way): run by `make check`, left
# out of the default suite to keep it under 10 minutes on 2 cores.
VARIANTS = {
    "unknown-section", "kv-heads-not-divisor", "heads-over-tensor", "micro-batches-not-divisor",
    "recipe-without-get-config", "experiment-missing", "corpus-empty", "tokenizer-not-a-model", "prepared-unfinished",
    "sft-row-without-messages", "sft-template-file-missing", "output-dir-uncreatable", "resume-with-another-lr",
    "sft-alpaca-without-output",
    "hf-import-pickles-only", "hf-export-output-taken", "compress-output-taken", "init-from-own-directory",
    "init-from-contradicting-flag", "launcher-env-not-a-number", "eval-config-not-json", "eval-no-tokenizer",
    "eval-newest-truncated", "eval-unknown-split", "eval-tasks-no-choices", "eval-output-unwritable",
    "generate-no-new-tokens", "generate-prompts-file-missing", "prepare-output-is-a-file",
    "tokenizer-encode-missing-model", "tokenizer-decode-out-of-range", "plan-no-devices", "unknown-format",
    "linked-keys-contradict", "tokenizer-vocab-too-large", "prepare-chat-tokenizer-without-template",
    "eval-chat-file-bad-row", "init-from-tokenizer-vocab", "process-id-out-of-range", "eval-corpus-empty", "eval-dtype",
    "generate-param-dtype", "prepare-tokenizer-missing", "tokenizer-vocab-too-small", "eval-config-edited",
    "generate-negative-temperature",
    # the same fallback reached through inference.load_run as eval-newest-damaged, through newest_loadable as
    # resume-every-checkpoint-damaged; compress's and the pipeline's other setting checks stay in the default suite
    "generate-newest-damaged", "eval-every-checkpoint-damaged", "init-from-every-checkpoint-damaged",
    "compress-group-odd", "pipeline-layers-not-divisible",
    # the same recipe file and command as tests/test_config_errors.py's recipe-syntax case, which checks the
    # whole of stderr
    "recipe-syntax-error",
}
CASES = [dataclasses.replace(c, slow=True) if c.name in VARIANTS else c for c in CASES]


# ----------------------------------------------------------------------------- generated: every path flag and key

# Each class of bad path (tests/test_paths.py checks every class on every declared flag and key in this process)
# with its value and a word of its line; the real commands below each meet one class, rotating, so that every
# command and every class is seen through a real CLI.
PATH_CLASSES = {
    "not-utf8": ("{case}/r\udcff", "UTF-8 text"),
    "name-too-long": ("{case}/" + "n" * 300, "bytes and the filesystem allows"),
    "missing": ("{case}/missing/x", "does not exist"),
    "dir-for-file": ("{case}", "is a directory"),
    "file-for-dir": ("{corpus}", "is a file"),
    "under-a-file": ("{corpus}/x", "nothing can be written under it"),
    "in-checkpoints": ("{run}/checkpoints/99", "is inside the checkpoints of"),
}
# (a module's `make_parser`, the words of its subcommands): the commands with declared path flags
PATH_COMMANDS = ("evaluate", "generate", "hf", "compress.cli", "data.prepare", "data.tokenizer", "experiment")
# The first of these cases stay in the default suite; the rest run in `make check`
PATH_CASES_FAST = 1


def _applies(name: str, kind: str, io: str) -> bool:
    return {"dir-for-file": kind == "file", "file-for-dir": kind == "dir", "missing": io == "in",
            "under-a-file": io == "out", "in-checkpoints": io == "out"}.get(name, True)


def _next_class(turn: int, kind: str, io: str) -> tuple[str, int]:
    """The first class at or after `turn` (in PATH_CLASSES' order, round) that applies; the next turn."""
    names = list(PATH_CLASSES)
    for step in range(len(names)):
        name = names[(turn + step) % len(names)]
        if _applies(name, kind, io):
            return name, turn + step + 1
    raise AssertionError((kind, io))


def _good_path(kind: str, io: str) -> str:
    return "{case}/new" if io == "out" else "{corpus}" if kind == "file" else "{tok}" if kind == "any" else "{run}"


def _path_cases() -> list[Case]:
    import argparse
    import importlib

    def required(parser, skip):
        for action in parser._actions:
            if action is skip or isinstance(action, argparse._SubParsersAction):
                continue
            if hasattr(action, "jaxlm_path"):
                value = _good_path(*action.jaxlm_path)
            elif getattr(action.type, "__name__", "") in ("int", "float"):
                value = "1"
            else:
                value = str(next(iter(action.choices))) if action.choices else "x"
            if not action.option_strings and action.nargs not in ("?", "*"):
                yield value
            elif action.option_strings and action.required:
                yield f"{action.option_strings[0]}={value}"

    targets = []  # (command, subcommand words, parser, action)
    for command in PATH_COMMANDS:
        top = importlib.import_module(f"jaxlm.{command}").make_parser()
        subs = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
        parsers = [((), top)] if not subs else [((w,), p) for w, p in subs[0].choices.items()]
        targets += [(command, words, parser, a) for words, parser in parsers for a in parser._actions
                    if hasattr(a, "jaxlm_path")]
    from jaxlm import config

    keys = [(f"config.{n}.{f.name}", *f.metadata["path"]) for n, cls in config.SECTIONS.items()
            for f in dataclasses.fields(cls) if f.metadata.get("path")]
    out, turn = [], 0
    for command, words, parser, action in targets:
        flag = action.option_strings[0] if action.option_strings else action.dest
        name, turn = _next_class(turn, *action.jaxlm_path)
        value, word = PATH_CLASSES[name]
        given = f"{flag}={value}" if action.option_strings else value
        label = flag.lstrip("-") if action.option_strings else "file"
        module = command.removesuffix(".cli")  # (python -m jaxlm.compress runs compress.cli's main)
        out.append(Case(f"path-{module.split('.')[-1]}{'-' + words[0] if words else ''}-{label}-{name}", module,
                        (*words, *required(parser, action), given), 2, (f"{flag}=" if action.option_strings else "",
                                                                        word), unchanged="{run}"))
    for key, kind, io in keys:
        name, turn = _next_class(turn, kind, io)
        value, word = PATH_CLASSES[name]
        out.append(Case(f"path-train-{key.removeprefix('config.')}-{name}", "train", T(f"--{key}={value}"), 2,
                        (word,), unchanged="{run}"))
    return [dataclasses.replace(c, slow=i >= PATH_CASES_FAST) for i, c in enumerate(out)]


PATH_CASES = _path_cases()
CASES += PATH_CASES


# ----------------------------------------------------------------------------- running them


def _fill(arg: str, case_dir: pathlib.Path, world: dict) -> str:
    return arg.format(case=case_dir, run=world["run"], copy=case_dir / "facts", corpus=world["corpus"],
                      prepared=world["prepared"], tok=world["run"] / "tokenizer.model")


def _argv(case: Case, case_dir: pathlib.Path, world: dict) -> list[str]:
    args = list(case.args)
    if args[:1] == ["@facts"]:  # the facts run's own command, on the copy in the case's directory
        args = [*train_args(case_dir, steps=40), "--config.checkpoint.every_steps=20", *args[1:]]
        args = [a.replace(f"--config.data.corpus={case_dir / 'facts.txt'}", f"--config.data.corpus={world['corpus']}")
                for a in args]
    return [sys.executable, "-m", f"jaxlm.{case.command}", *(_fill(a, case_dir, world) for a in args)]


def _snapshot(root: pathlib.Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _run_case(case: Case, case_dir: pathlib.Path, world: dict, forks: CommandForks | None = None,
              output: pathlib.Path | None = None) -> dict:
    case_dir.mkdir(parents=True)
    held = case.setup(case_dir, world) if case.setup else None  # a lock, for the run-dir-in-use case
    watched = pathlib.Path(_fill(case.unchanged, case_dir, world)) if case.unchanged else None
    before = _snapshot(watched) if watched else {}
    env = dict(ONE_DEVICE if case.one_device else os.environ, PYTHONUNBUFFERED="1", **dict(case.env))
    argv = _argv(case, case_dir, world)
    # forked from the server when that is the same command: its environment is the server's (JAX has read
    # its variables there) and nothing reads its output while it runs (a signal sent at a line of it)
    forked = forks is not None and output is not None and env == forks.env and case.signal_after is None

    def limit() -> None:
        if case.file_size_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.file_size_limit, case.file_size_limit))

    def run_forked(name: str, file_size_limit: int) -> tuple[int, str, str]:
        out, err = output / f"{case.name}.{name}.out", output / f"{case.name}.{name}.err"
        code = forks.run(case.command, argv[3:], cwd=ROOT, stdout=out, stderr=err, file_size_limit=file_size_limit,
                         timeout=600)
        return code, out.read_text(), err.read_text()

    if forked:
        code, out, err = run_forked("first", case.file_size_limit)
        result = {"code": code, "out": out, "err": err}
    else:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=limit)
        seen, seen_err = [], []
        if case.signal_after:
            name, prefix = case.signal_after
            if not prefix:
                time.sleep(case.signal_delay)  # a moment into the work, after the imports
            else:
                stream, lines = (proc.stderr, seen_err) if prefix.startswith("stderr:") else (proc.stdout, seen)
                prefix = prefix.removeprefix("stderr:")
                for line in stream:
                    lines.append(line)
                    if line.startswith(prefix):
                        break
            proc.send_signal(getattr(signal, name))
        out, err = proc.communicate(timeout=600)
        result = {"code": proc.returncode, "out": "".join(seen) + out, "err": "".join(seen_err) + err}
    result.update(argv=argv, forked=forked, changed=watched is not None and _snapshot(watched) != before)
    if isinstance(held, RunLock):
        held.release()
    if case.then == "resumes":
        if forked:
            code, _, err = run_forked("then", 0)  # (the disk has room again)
            result["then"] = (code, err[-2000:])
        else:
            again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            result["then"] = (again.returncode, again.stderr[-2000:])
    return result


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """The fork server (tests/command_forks.py) with this session's environment, started while the world
    trains; None under JAXLM_TEST_NO_FORK=1. Its own stderr must stay empty (no warning at import or fork)."""
    if os.environ.get("JAXLM_TEST_NO_FORK") == "1":
        yield None
        return
    server = CommandForks(ROOT, dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path_factory.mktemp("forks") / "server.err")
    try:
        yield server
    finally:
        said = server.close()
    assert said == "", f"the fork server wrote to its stderr:\n{said[-3000:]}"
    assert server.info["python_threads"] == 1, server.info


@pytest.fixture(scope="module")
def world(source_run, forks, tmp_path_factory):
    """The shared inputs: a trained run (checkpoints 20 and 40: the session's, tests/conftest.py, which
    tests/test_init_from.py reads too), its corpus, the corpus prepared (forked from the server where
    there is one)."""
    root = tmp_path_factory.mktemp("world")
    corpus, prepared = source_run.parent / "facts.txt", root / "prepared"
    args = [f"--input={corpus}", "--separator=\\n\\n", f"--tokenizer={source_run / 'tokenizer.model'}",
            f"--output={prepared}", "--workers=1"]
    if forks is None:
        subprocess.run([sys.executable, "-m", "jaxlm.data.prepare", *args], cwd=ROOT, check=True, capture_output=True,
                       timeout=600)
    else:
        out, err = root / "prepare.out", root / "prepare.err"
        code = forks.run("data.prepare", args, cwd=ROOT, stdout=out, stderr=err, timeout=600)
        assert code == 0, err.read_text()[-3000:]
    return {"run": source_run, "corpus": corpus, "prepared": prepared, "cases": tmp_path_factory.mktemp("cases")}


@pytest.fixture(scope="module")
def results(forks, world, request, tmp_path_factory):
    """Every case selected in this session, run three at a time."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec")]
    run_before = _snapshot(world["run"])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        output = tmp_path_factory.mktemp("output")  # the forked commands' stdout and stderr
        futures = {c.name: pool.submit(_run_case, c, world["cases"] / c.name, world, forks, output) for c in selected}
        done = {name: f.result() for name, f in futures.items()}
    assert _snapshot(world["run"]) == run_before, "a case changed the shared run"
    return done


def test_the_catalogue_is_large_and_its_names_unique():
    assert len(CASES) >= 70
    assert len({c.name for c in CASES}) == len(CASES)


def test_the_generated_path_cases_meet_every_class_and_every_command():
    assert {c.name.rsplit("-", 1)[0] for c in PATH_CASES} and len(PATH_CASES) >= 20
    assert {name for name in PATH_CLASSES if any(c.name.endswith(name) for c in PATH_CASES)} == set(PATH_CLASSES)
    assert {c.command for c in PATH_CASES} == {*(c.removesuffix(".cli") for c in PATH_COMMANDS), "train"}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in CASES])
def test_bad_input(case: Case, results):
    r = results[case.name]
    where = f"{' '.join(r['argv'][2:])}\nstdout: {r['out'][-1500:]}\nstderr: {r['err'][-3000:]}"
    codes = case.code if isinstance(case.code, tuple) else (case.code,)
    assert r["code"] in codes, where
    assert "Traceback" not in r["err"], where
    # nor the records of the libraries underneath (at INFO for every logger, Orbax's fill a screen)
    assert not any(word in r["err"] for word in ("CheckpointManager", "orbax", "absl")), where
    if r["code"] in (2, 74):
        # jaxlm's own line, or argparse's (after its usage) for a flag it does not know
        lines = [line for line in r["err"].splitlines() if line.startswith("jaxlm: error:") or ": error: " in line]
        assert len(lines) == 1, where
        text = lines[0]
    elif r["code"] == 0:
        lines = [line for line in r["err"].splitlines() if "WARNING" in line or "warning" in line]
        assert len(lines) == 1, where
        text = lines[0]
    else:
        text = r["err"]
    for word in case.words:
        assert word in text, f"{word!r} not in: {text}\n{where}"
    assert not r["changed"], f"{case.unchanged} changed\n{where}"
    if case.no_progress_bar:
        assert "docs/s" not in r["err"] and "prepare:" not in r["err"], where
    if case.then == "resumes":
        assert r["then"][0] == 0, f"the same command afterwards: {r['then']}"


@pytest.fixture
def read_only_copy(world, tmp_path):
    """A copy of the shared run on a read-only filesystem (a read-only bind mount as root, whom file
    modes do not stop; the modes otherwise)."""
    run = tmp_path / "ro" / "facts"
    shutil.copytree(world["run"], run)
    mounted = False
    if os.geteuid() == 0:
        where = str(tmp_path / "ro")
        bind = subprocess.run(["mount", "--bind", where, where], capture_output=True)
        if bind.returncode != 0:
            pytest.skip(f"no read-only mount here ({bind.stderr.decode().strip()})")
        mounted = True
        if subprocess.run(["mount", "-o", "remount,ro,bind", where], capture_output=True).returncode != 0:
            subprocess.run(["umount", where])
            pytest.skip("no read-only remount here")
    else:
        for p in (run, *run.rglob("*")):
            p.chmod(p.stat().st_mode & ~0o222)
    try:
        yield run
    finally:
        if mounted:
            subprocess.run(["umount", str(tmp_path / "ro")], check=True)
        else:
            for p in (run, *run.rglob("*")):
                p.chmod(p.stat().st_mode | 0o200)


@pytest.mark.slow
def test_a_read_only_run_is_fully_usable(read_only_copy, world, tmp_path):
    """Issue 47 item 5: evaluate, generate, export and explore read a run they cannot write; evaluate's
    results go to stdout (its default file is skipped with a warning, exit 0)."""
    run = read_only_copy
    with pytest.raises(OSError):
        (run / "probe").write_text("x")  # (the copy is read-only indeed)
    commands = {
        "generate": ["--run_dir", str(run), "--prompt=alice likes", "--max_new_tokens=4"],
        "evaluate": ["--run_dir", str(run), f"--corpus={world['corpus']}", "--max_tokens=512"],
        "hf": ["export", "--run_dir", str(run), f"--output={tmp_path / 'hf'}"],
    }
    for command, args in commands.items():
        done = subprocess.run([sys.executable, "-m", f"jaxlm.{command}", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
        if command == "evaluate":
            assert "| " in done.stdout and "perplexity" in done.stdout, done.stdout  # the results table, printed
            assert "were not written to the run directory" in done.stderr, done.stderr
    assert (tmp_path / "hf" / "config.json").is_file()
    loaded = subprocess.run([sys.executable, "-c", f"from jaxlm import explore; print(explore.load({str(run)!r}).step)"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "40", loaded.stderr[-2000:]
