"""The base recipe: every key with its default (defined in jaxlm.config.base_config)."""

from jaxlm.config import base_config


def get_config():
    return base_config()
