"""Fine-tuning as a TRL or axolotl user runs it (issue 48; docs/fine-tuning.md's walk-through), through
the CLIs: a Hugging Face model imported, fine-tuned with a recipe of configs/ on chat rows shorter than
its context, prompted with `generate --chat`, exported merged and as a PEFT adapter. The fine-tune
keeps the base's context and RoPE scaling, reports its trainable parameters and the base's held-out
loss before the first step."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
from command_forks import run_command
from test_hf import make_model, save

from jaxlm import config, hf, run_dir
from tiny_run import ONE_DEVICE, ROOT

CONVERSATIONS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                               {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
                 for a in range(12) for b in range(12)]


def _train(*args: str) -> subprocess.CompletedProcess:
    return run_command("train", args, cwd=ROOT, env=ONE_DEVICE, timeout=900)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> pathlib.Path:
    """A transformers Llama with Llama 3.1's RoPE scaling and 128 positions, saved and imported."""
    root = tmp_path_factory.mktemp("finetune")
    hf_dir = save(make_model("llama3_scaled"), root / "hf")
    return hf.import_checkpoint(hf_dir, root / "base")


@pytest.mark.slow  # ~1 min: a LoRA SFT run of 4 steps and an export
def test_a_lora_sft_on_short_rows_keeps_the_context_and_reports_what_it_trains(imported, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    done = _train("--config=configs/sft_lora.py", f"--config.run.init_from={imported}",
                  f"--config.data.corpus={chats}", "--config.data.chat_template=simple", "--config.data.seq_len=96",
                  "--config.data.global_batch_size=8", "--config.run.steps=4", "--config.run.eval_every=0",
                  "--config.optim.warmup_steps=1", f"--config.run.output_dir={tmp_path}", "--config.run.name=sft",
                  f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.run.compile_cache_dir=")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "sft"
    saved = json.loads((run / "config.json").read_text())
    assert (saved["model"]["max_seq_len"], saved["data"]["seq_len"]) == (128, 96)  # the base's context, short rows
    assert saved["model"]["rope_scaling"] == "llama3" and saved["lora"]["rank"] == 16

    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < summary["params"]
    assert f"({summary['trainable_params'] / 1e3:.1f}K trainable, " in done.stdout + done.stderr
    records = run_dir.read_jsonl(run / "metrics.jsonl")
    first = [r for r in records if r.get("step") == 0]
    assert len(first) == 1 and first[0]["val_loss"] == summary["initial_val_loss"] > 0  # the base's loss, logged
    assert "(before the first step)" in done.stdout + done.stderr

    chat = run_command("generate", [f"--run_dir={run}", "--chat", "--prompt=What is 3 plus 4?", "--temperature=0",
                                    "--max_new_tokens=4", "--json"], cwd=ROOT, env=ONE_DEVICE, timeout=600)
    assert chat.returncode == 0, chat.stderr[-3000:]
    answer = json.loads(chat.stdout.splitlines()[-1])
    assert 0 < len(answer["ids"]) <= 4  # (a 4-step fine-tune of a random model: the format, not the sum)

    exported = hf.export_run(run, tmp_path / "merged", dtype="float32")
    written = json.loads((exported / "config.json").read_text())
    assert written["max_position_embeddings"] == 128
    assert written["rope_scaling"]["rope_type"] == "llama3"
    adapter = hf.export_run(run, tmp_path / "adapter", dtype="float32", adapters="peft")
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        (imported.parent / "hf").resolve())


def test_the_fine_tuning_recipes_hold_the_defaults_their_docstrings_state():
    """PEFT's, TRL's and the QLoRA paper's settings (configs/sft_*.py), and an evaluation before the first step."""
    lora, qlora, full = (config.load_recipe(name) for name in ("sft_lora", "sft_qlora", "sft_full"))
    for c in (lora, qlora, full):
        config.validate(c)
        assert (c.optim.weight_decay, c.optim.b2, c.run.eval_at_start, c.checkpoint.every_minutes) == (0.0, 0.999, "on", 0)
        assert c.data.format == "chat" and c.optim.warmup_steps == round(0.03 * c.run.steps)
    assert (lora.lora.rank, lora.lora.alpha, lora.lora.dropout, lora.optim.peak_lr) == (16, 32.0, 0.05, 2e-4)
    assert (qlora.lora.quantize_base, qlora.lora.double_quant, qlora.lora.rank, qlora.optim.clip_norm) == (
        "nf4", True, 64, 0.3)
    assert (full.lora.rank, full.optim.peak_lr) == (0, 2e-5)


def test_eval_at_start_is_on_for_a_fine_tune_by_default():
    base = config.load_recipe("tiny")
    assert not run_dir.eval_at_start(base.run)
    base.run.init_from = "runs/base"
    assert run_dir.eval_at_start(base.run)
    base.run.eval_at_start = "off"
    assert not run_dir.eval_at_start(base.run)
