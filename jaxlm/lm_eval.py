"""lm-evaluation-harness on a jaxlm run: the harness's `jaxlm` model, and the harness's command line with it.

    python -m jaxlm.evaluate --run_dir=runs/tiny --lm_eval_tasks=hellaswag,arc_easy [--lm_eval_include_path=DIR]
    python -m jaxlm.lm_eval --model jaxlm --model_args run_dir=runs/tiny --tasks hellaswag [the harness's flags]

The harness (the optional extra `eval`: `pip install 'jaxlm[eval]'`, a pinned version) builds each task's
requests and computes its metrics; `JaxLM` answers the requests on the run's mesh, in batches sorted by
length and padded to a few lengths (`jaxlm.scoring`): `loglikelihood` with the scorer `jaxlm.evaluate`
scores multiple-choice files with, `loglikelihood_rolling` over the harness's own windows, and
`generate_until` with the KV-cache sampler of `jaxlm.generate` (greedy unless a task samples), stopping
at EOS or a task's `until` strings, whose first occurrence ends the answer.

Texts are tokenized as the harness's `hf` model tokenizes them for the run's Hugging Face copy (`python -m
jaxlm.hf export`), so that the two give the same numbers: a continuation is split from its context as
`scoring.encode_pair` says; BOS leads a context, a generation prompt and a rolling document exactly where
the tokenizer's own convention puts it (`Tokenizer.adds_bos`: always, for a tokenizer trained here; for an
imported Hugging Face one, as its tokenizer_config.json says: Llama yes, GPT-2 and Qwen no), unless
`add_bos_token` says otherwise; an empty context is BOS (else EOS). As `hf` does, a rolling document that
begins with BOS also gets the BOS prefix its first window is predicted from, so BOS's own log-likelihood
after BOS counts too.

The harness reads no entry points: importing this module registers the name `jaxlm` (a lazy reference to
`JaxLM`), which `python -m jaxlm.lm_eval` does before it runs the harness's command line.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlm import generate, inference, scoring
from jaxlm.errors import UserError, run_command

try:  # the optional extra `eval`: without it this module still imports, and `require_harness` says what to install
    import lm_eval as harness
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    _MISSING: ImportError | None = None
except ImportError as e:
    harness, LM, _MISSING = None, object, e

log = logging.getLogger(__name__)

MODEL_NAME = "jaxlm"  # --model jaxlm
MAX_GEN_TOKS = 256  # generate_until's default length where a task gives none (as the harness's hf model)
SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}  # the generation settings of a task that are used


def require_harness() -> None:
    """Raise the one line that says to install the harness, where it does not import."""
    if _MISSING is not None:
        missing = getattr(_MISSING, "name", None) or ""
        why = "is not installed" if missing.split(".")[0] == "lm_eval" else f"does not import ({_MISSING})"
        raise UserError(f"lm-evaluation-harness {why}; install jaxlm's extra: pip install 'jaxlm[eval]' "
                        f"(in a checkout: pip install -e '.[eval]')")


def register() -> None:
    """Make `jaxlm` the harness's name for `JaxLM` (once; a lazy reference, which `python -m jaxlm.lm_eval`,
    running this file as __main__, shares with any later import of this module)."""
    require_harness()
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="jaxlm.lm_eval:JaxLM")


def _batch_size(value: Any) -> int | None:
    """The harness's --batch_size: rows per compiled batch; 'auto' (or none): the run's data.global_batch_size."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"batch_size={value!r}: give a positive number of rows, or auto (the run's data.global_batch_size)")
    return value


class JaxLM(LM):
    """The harness's model for a jaxlm run: `--model jaxlm --model_args run_dir=DIR[,step=N][,dtype=float32]...`.

    `run_dir`, `step`, `dtype`, `param_dtype`: the checkpoint, as `inference.load_run` reads it (or `run`, one
    loaded already, and `scorer`, its `scoring.make_scorer` where one is compiled already). `batch_size`: rows
    per compiled batch (the harness's --batch_size; auto: the run's data.global_batch_size). `max_length`: the
    longest sequence scored or generated in (default and most: the model's context, model.max_seq_len).
    `add_bos_token`: BOS before every text, or never (default: the tokenizer's convention, as the module
    docstring says). `prefix_token_id`: an empty context (default BOS, else EOS). `max_gen_toks`:
    generation's length where a task gives none.

    Every process of a multi-process run answers every request (the mesh spans them); the harness sees one
    rank. The chat-template options of the harness are not supported.
    """

    def __init__(self, run_dir: str | None = None, step: int | None = None, dtype: str | None = None,
                 param_dtype: str | None = None, batch_size: int | str | None = None, max_length: int | None = None,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 max_gen_toks: int = MAX_GEN_TOKS, run: inference.LoadedRun | None = None, scorer=None,
                 device: str | None = None, max_batch_size: int | None = None, **unknown):
        require_harness()
        super().__init__()
        if unknown:
            raise UserError(f"--model_args: jaxlm takes no {', '.join(sorted(unknown))}; it takes run_dir, step, dtype, "
                            f"param_dtype, batch_size, max_length, add_bos_token, prefix_token_id, max_gen_toks")
        if run is None and not run_dir:
            raise UserError("--model_args: give run_dir=<a jaxlm run directory> (e.g. --model_args run_dir=runs/tiny)")
        for name, value in (("add_bos_token", add_bos_token),):
            if value is not None and not isinstance(value, bool):
                raise UserError(f"{name}={value!r}: give true or false")
        for name, value, least in (("max_length", max_length, 2), ("max_gen_toks", max_gen_toks, 1),
                                   ("step", step, 0), ("prefix_token_id", prefix_token_id, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise UserError(f"{name}={value!r}: give a whole number, at least {least}")
        if device is not None:
            log.warning("device=%s is ignored: jaxlm runs on the devices JAX finds (JAX_PLATFORMS chooses)", device)
        self.batch_size = _batch_size(batch_size)
        self.run = run or inference.load_run(run_dir, step=step, dtype=dtype, param_dtype=param_dtype)
        tok, context = self.run.tokenizer, self.run.model_cfg.max_seq_len
        if max_length is not None and max_length > context:
            raise UserError(f"max_length={max_length}: give at most the model's context, {context} tokens")
        self.max_length = max_length or context
        self.add_bos = tok.adds_bos if add_bos_token is None else add_bos_token and tok.bos_id >= 0
        if prefix_token_id is not None and prefix_token_id >= tok.vocab_size:
            raise UserError(f"prefix_token_id={prefix_token_id} is outside the vocabulary (0..{tok.vocab_size - 1})")
        self.prefix_id = scoring.prefix_id(tok) if prefix_token_id is None else prefix_token_id
        self.max_gen_toks = max_gen_toks
        self.scorer = scorer or scoring.make_scorer(self.run)
        self._generator: generate.Generator | None = None
        self._draws = 0  # generation calls that sample: each draws with its own seed

    @property
    def generator(self) -> generate.Generator:
        """The sampler `generate_until` uses (`jaxlm.generate`), made at its first use."""
        if self._generator is None:
            self._generator = generate.Generator.from_run(self.run)
        return self._generator

    @property
    def tokenizer_name(self) -> str:
        return f"jaxlm-{self.run.tokenizer.sha256[:16]}"

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records of the model in its results."""
        return {"run_dir": str(self.run.run_dir), "step": self.run.step, "max_length": self.max_length,
                "add_bos_token": self.add_bos}

    # ------------------------------------------------------------------------- log-likelihoods

    def _score(self, requests: Sequence[tuple[np.ndarray, int]]) -> list[tuple[float, bool]]:
        return scoring.score_continuations(self.run, requests, batch_size=self.batch_size, scorer=self.scorer)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether it is the greedy continuation) for each (context, continuation)."""
        args = [request.args for request in requests]
        tok = self.run.tokenizer
        scored = self._score([scoring.continuation_request(
            *scoring.encode_pair(tok, context, continuation, self.add_bos, self.prefix_id), self.max_length)
            for context, continuation in args])
        for arg, result in zip(args, scored):
            self.cache_hook.add_partial("loglikelihood", arg, result)
        return scored

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of each (text,): every token predicted once, in the harness's windows of `max_length`."""
        windows, owners = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            ids = scoring.encode(self.run.tokenizer, text, self.add_bos)
            for context, predicted in map(make_disjoint_window,
                                          get_rolling_token_windows(ids, self.prefix_id, self.max_length, 1)):
                windows.append((np.asarray(context + predicted, np.int32), len(predicted)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._score(windows)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------------- generation

    def _sampling(self, settings: dict[str, Any]) -> generate.Sampling:
        ignored = sorted(set(settings) - SAMPLING_KEYS)
        if ignored:
            log.warning("generation settings ignored by jaxlm: %s", ", ".join(ignored))
        if not settings.get("do_sample"):
            return generate.GREEDY
        return generate.Sampling(float(settings.get("temperature") or 1.0), int(settings.get("top_k") or 0),
                                 float(settings.get("top_p") or 1.0))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The text generated after each (context, settings): up to EOS, the first of the settings' `until`
        strings or `max_gen_toks` tokens; requests with the same settings are generated in batches."""
        tok = self.run.tokenizer
        eos = tok.token_text(tok.eos_id) if tok.eos_id >= 0 else None
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        for members in groups.values():
            settings = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(settings.pop("until", None), eos=eos)
            max_gen = settings.pop("max_gen_toks")
            sampling = self._sampling(settings)
            room = self.max_length - max_gen
            if room < 1:
                raise UserError(f"a task generates up to {max_gen} tokens, which leaves no room for its prompt in "
                                f"max_length={self.max_length}; give a longer max_length, or max_gen_toks below it")
            prompts = {i: scoring.encode(tok, requests[i].args[0], self.add_bos)[-room:] or [self.prefix_id]
                       for i in members}
            order = sorted(members, key=lambda i: len(prompts[i]))  # similar lengths share a batch
            size = self.batch_size or self.run.cfg.data.global_batch_size
            for start in range(0, len(order), size):
                chunk = order[start : start + size]
                completions = self.generator.generate_ids(
                    [prompts[i] for i in chunk], max_new_tokens=max_gen, sampling=sampling, seed=self._draws,
                    finished=lambda tokens, until=until: all(self._stopped(row, until) for row in tokens))
                self._draws += int(sampling.temperature > 0)
                for i, completion in zip(chunk, completions):
                    out[i] = postprocess_generated_text(tok.decode(completion.ids), until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _stopped(self, tokens: np.ndarray, until: Sequence[str]) -> bool:
        """Whether a row's new tokens so far end its answer: EOS, or one of the `until` strings in their text."""
        eos = self.run.tokenizer.eos_id
        ids = tokens.tolist()
        if eos >= 0 and eos in ids:
            return True
        text = self.run.tokenizer.decode(ids)
        return any(term and term in text for term in until)


if harness is not None:
    register()


# ----------------------------------------------------------------------------- running tasks


def task_manager(names: Sequence[str], include_path: str | None = None):
    """The harness's TaskManager for task names (and task YAML files under `include_path`), each name checked:
    an unknown one is one line, before any checkpoint loads. Only the tasks under `include_path` are indexed
    when they hold every name (the harness's own thousands take seconds)."""
    require_harness()
    from lm_eval.tasks import TaskManager  # local import: builds nothing until called, but pulls in the tasks' code

    if include_path is not None and not pathlib.Path(include_path).is_dir():
        raise UserError(f"--lm_eval_include_path={include_path}: no such directory; give the directory of your task "
                        f"YAML files")
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not set(names) - set(local.all_tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in manager.all_tasks and not manager.match_tasks([n])]
    if unknown:
        where = f" or in {include_path}" if include_path else "; tasks of your own: --lm_eval_include_path=DIR"
        raise UserError(f"--lm_eval_tasks: no lm-evaluation-harness task {', '.join(map(repr, unknown))} among the "
                        f"harness's {len(manager.all_tasks)}{where} (list them: python -m jaxlm.lm_eval ls tasks)")
    return manager


def run_tasks(run: inference.LoadedRun, names: Sequence[str], manager, *, num_fewshot: int | None = None,
              limit: int | None = None, batch_size: int | None = None, scorer=None) -> dict[str, Any]:
    """The harness's results for tasks `names` (of `task_manager`'s `manager`) on a loaded run: per task,
    its metrics (`acc,none`, `acc_stderr,none`, ...) and, under `n-samples`, how many examples it scored."""
    require_harness()
    results = harness.simple_evaluate(
        model=JaxLM(run=run, scorer=scorer, batch_size=batch_size), tasks=list(names), num_fewshot=num_fewshot,
        limit=limit, task_manager=manager, log_samples=False,
        torch_random_seed=None)  # no torch import: the harness seeds torch wherever it is installed, if given a seed
    kept = {key: results.get(key, {}) for key in ("results", "n-samples", "versions", "n-shot")}
    return json.loads(json.dumps(kept, default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))


# ----------------------------------------------------------------------------- the harness's command line


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxlm.lm_eval ...`: the harness's own command line (`lm-eval`), with `--model jaxlm` known."""
    return run_command(lambda: _main(sys.argv[1:] if argv is None else list(argv)),
                       resume="run the same command again")


def _main(argv: list[str]) -> int:
    require_harness()
    register()
    from lm_eval.__main__ import cli_evaluate  # local import: the harness's command line, only for this command

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # the harness's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
