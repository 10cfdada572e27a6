"""Typed config sections (`jaxlm.section`): each owns its keys' defaults, docs and checks, and the
config users write (recipes, `--config.` overrides, config.json) is built from and read into them."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jaxlm import config
from jaxlm.errors import UserError

SECTIONS = sorted(config.SECTIONS)


def test_every_typed_section_is_registered_under_its_own_name():
    assert SECTIONS and all(config.SECTIONS[name].section == name for name in SECTIONS)


@pytest.mark.parametrize("name", SECTIONS)
def test_base_config_holds_the_sections_defaults_with_their_types(name):
    cls = config.SECTIONS[name]
    section = config.base_config()[name]
    assert section.to_dict() == cls.defaults()
    assert {k: type(v) for k, v in section.to_dict().items()} == {k: type(v) for k, v in cls.defaults().items()}
    assert cls.from_config(section) == cls()
    assert all(cls.docs().values()), [k for k, v in cls.docs().items() if not v]


@pytest.mark.parametrize("name", SECTIONS)
def test_a_run_config_json_of_any_recipe_reads_into_its_section(name):
    for recipe in config.recipe_names():
        if recipe == "base":
            continue
        cfg = config.load_recipe(recipe)
        config.SECTIONS[name].from_config(cfg[name]).validate()


@pytest.mark.parametrize("key, value, words", [
    ("checkpoint.keep_last", 0, "config.checkpoint.keep_last=0 is not allowed: 1 or more"),
    ("checkpoint.every_minutes", -1.0, "config.checkpoint.every_minutes=-1.0 is not allowed: 0 (off) or more"),
    ("checkpoint.snapshot", "always", "one of 'auto', 'device', 'host', 'off'"),
    ("optim.b2", 1.0, "config.optim.b2=1.0 is not allowed: a number in [0, 1)"),
    ("optim.schedule", "step", "one of 'cosine', 'wsd', 'linear', 'constant', 'cyclic'"),
    ("energy.poll_s", 0.0, "config.energy.poll_s=0.0 is not allowed"),
    ("metrics.progress", "fancy", "one of 'auto', 'bar', 'lines'"),
    ("pipeline.repeats", 2, "config.pipeline.repeats=2 is not allowed: 1 with pipeline.schedule='gpipe'"),
    ("run.steps", 0, "config.run.steps=0 is not allowed: a positive integer"),
    ("run.init_step", 3, "-1 while run.init_from is empty"),
    ("model.variant", "gpt3", "one of 'gpt2', 'llama', 'qwen2'"),
    ("model.n_kv_heads", 3, "config.model.n_kv_heads=3 is not allowed: a divisor of model.n_heads=4"),
    ("data.val_fraction", 1.0, "config.data.val_fraction=1.0 is not allowed: a number in [0, 1)"),
    ("data.tokenizer_type", "wordpiece", "one of bpe, unigram, char, byte"),
    ("lora.alpha", 0.0, "config.lora.alpha=0.0 is not allowed: a positive number"),
    ("compress.method", "awq", "config.compress.method='awq' is not allowed: rtn or gptq"),
    ("compress.pattern", "4:2", "unstructured, or N:M with 0 < N < M"),
    ("profile.steps", "5:3", "'start:end' with 1 <= start <= end"),
    ("mesh.hybrid", "rack", "one of 'process', 'host', 'slice' or ''"),
    ("mesh.tensor", 0, "config.mesh.tensor=0 is not allowed: a positive integer or -1"),
])
def test_a_bad_value_is_one_line_from_the_section(key, value, words):
    section, field = key.split(".")
    bad = dataclasses.replace(config.SECTIONS[section](), **{field: value})
    with pytest.raises(UserError, match=re.escape(words)) as raised:
        bad.validate()
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match="is not allowed"):  # and through the config users write
        config.recipe("tiny", **{key.replace(".", "__"): value})


@pytest.mark.parametrize("changes, words", [
    (dict(rope_original_max_len=0), "config.model.rope_original_max_len=0 is not allowed: the context length the "
                                    "model was trained with, a positive integer (rope_scaling=yarn needs it)"),
    (dict(rope_beta_fast=1.0), "config.model.rope_beta_fast=1.0 is not allowed: a number above "
                               "model.rope_beta_slow=1.0 > 0"),
    (dict(rope_beta_slow=0.0), "config.model.rope_beta_fast=32.0 is not allowed: a number above model.rope_beta_slow=0.0"),
    (dict(rope_factor=0.0), "config.model.rope_factor=0.0 is not allowed: a positive number"),
])
def test_yarn_without_what_it_needs_is_one_line(changes, words):
    yarn = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=128)
    bad = dataclasses.replace(config.SECTIONS["model"](), **{**yarn, **changes})
    with pytest.raises(UserError, match=re.escape(words)) as raised:
        bad.validate()
    assert "\n" not in str(raised.value)
    config.SECTIONS["model"](**yarn).validate()


def test_the_config_json_of_a_run_of_commit_a89b6fe_still_loads(tmp_path):
    """A run directory's config.json as that commit wrote it (the config stored in its checkpoint's
    metadata, before most of today's keys existed) reads over today's defaults into every section."""
    import json
    import pathlib

    from jaxlm import inference

    stored = pathlib.Path(__file__).parent / "data" / "checkpoint_a89b6fe" / "1" / "meta" / "metadata"
    saved = json.loads(stored.read_text())["config"]
    assert "ocdbt" not in saved["checkpoint"] and "energy" not in saved  # older than these keys
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = inference.read_config(tmp_path)
    for name, cls in config.SECTIONS.items():
        section = cls.from_config(cfg[name])
        section.validate()
        kept = saved.get(name, {})  # a section that did not exist then takes today's defaults
        for key, value in kept.items():  # a group of keys (mesh.rules) holds the saved ones and today's others
            now = getattr(section, key)
            assert ({k: now[k] for k in value} if isinstance(value, dict) else now) == value, key


def _keys_of_type(kind: str) -> list[str]:
    """Every key of every section declared with the type named `kind` (float, int, bool)."""
    return [f"{name}.{field.name}" for name, cls in config.SECTIONS.items() for field in dataclasses.fields(cls)
            if (field.type if isinstance(field.type, str) else field.type.__name__) == kind]


# Values no key of the type accepts, as the command line gives them (`--config.<key>=<text>`)
BAD_BY_TYPE = {"float": ("nan", "inf", "-inf", "1e999", "many"),
               "int": ("1.5", "nan", "inf", "many", str(2**62 + 1), str(-(2**62) - 1)),
               "bool": ("maybe", "2"), "str": ("r\udcff",)}  # (a file name in another encoding, as Python sees it)


# Keys that hold one value (a FieldReference in base_config): either's name is the value's
LINKED = {"data.seq_len": "model.max_seq_len", "data.tokenizer_vocab_size": "model.vocab_size"}


@pytest.mark.parametrize("kind", sorted(BAD_BY_TYPE))
def test_every_key_refuses_the_values_its_type_never_takes_in_one_line(kind):
    """By class, not by key: every float of every section refuses nan and the infinities, every int a
    fraction, nan or a size past any ceiling, every bool what is not one, every string what is not
    UTF-8, each as one line naming the key (generated from the sections: a new key is covered the day
    it is declared)."""
    keys = _keys_of_type(kind)
    assert len(keys) >= {"float": 20, "int": 40, "bool": 10, "str": 30}[kind], keys  # the enumeration found them
    for key in keys:
        for text in BAD_BY_TYPE[kind]:
            cfg = config.load_recipe("tiny")
            with pytest.raises(UserError) as raised:
                config.apply_overrides(cfg, [(key, text)])
                config.validate(cfg)
            message = str(raised.value)
            assert "\n" not in message and (key in message or LINKED.get(key, key) in message), (key, text, message)


def test_an_int_past_its_ceiling_is_refused_and_one_at_it_is_not_for_that_reason():
    """The ceiling (`section.INT_LIMIT`, or the key's own `limit`) is checked by magnitude."""
    from jaxlm.section import INT_LIMIT

    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("run.steps", str(INT_LIMIT + 1))])
    with pytest.raises(UserError, match=re.escape("config.run.steps=2147483648 is not allowed: an integer of at most "
                                                  "2,147,483,647 in magnitude")):
        config.validate(cfg)
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("run.steps", str(INT_LIMIT)), ("data.tokenizer_train_bytes", str(2**40))])
    config.validate(cfg)  # a byte count declares its own, larger limit


def test_a_non_finite_float_from_a_recipe_is_refused_as_from_the_command_line():
    """The check is the section's, not the parser's: a recipe (Python) that computes nan is refused too."""
    cfg = config.load_recipe("tiny")
    cfg.optim.peak_lr = float("nan")
    with pytest.raises(UserError, match=re.escape("config.optim.peak_lr=nan is not allowed: a finite number")):
        config.validate(cfg)
