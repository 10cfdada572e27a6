"""Typed config sections (`jaxlm.section`): each owns its keys' defaults, docs and checks, and the
config users write (recipes, `--config.` overrides, config.json) is built from and read into them."""

from __future__ import annotations

import dataclasses

import pytest

from jaxlm import config
from jaxlm.errors import UserError

SECTIONS = sorted(config.SECTIONS)


def test_every_typed_section_is_registered_under_its_own_name():
    assert SECTIONS and all(config.SECTIONS[name].name == name for name in SECTIONS)


@pytest.mark.parametrize("name", SECTIONS)
def test_base_config_holds_the_sections_defaults_with_their_types(name):
    cls = config.SECTIONS[name]
    section = config.base_config()[name]
    assert section.to_dict() == cls.defaults()
    assert {k: type(v) for k, v in section.items()} == {k: type(v) for k, v in cls.defaults().items()}
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
])
def test_a_bad_value_is_one_line_from_the_section(key, value, words):
    section, field = key.split(".")
    bad = dataclasses.replace(config.SECTIONS[section](), **{field: value})
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as raised:
        bad.validate()
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match="is not allowed"):  # and through the config users write
        config.recipe("tiny", **{key.replace(".", "__"): value})
