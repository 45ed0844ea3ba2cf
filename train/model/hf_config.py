"""Sections of a Hugging Face config.json as the families read them: a missing setting names
its section, where a field that several sections hold (hidden_size) would leave a bare
KeyError that says not which one lacks it."""

from __future__ import annotations

TOP_LEVEL = "top level"  # a flat config's own settings, outside text_config / vision_config


class MissingConfigField(KeyError):
    """A setting a config.json section lacks, with the section's name."""

    def __init__(self, key: str, section: str):
        super().__init__(key)
        self.key, self.section = key, section


class ConfigSection(dict):
    """A config.json section whose missing keys raise MissingConfigField."""

    def __init__(self, values: dict, section: str):
        super().__init__(values)
        self.section = section

    def __missing__(self, key):
        raise MissingConfigField(key, self.section)


def text_section(config: dict) -> ConfigSection:
    """The language model's settings: `text_config`, or the top level of a flat config."""
    if isinstance(config.get("text_config"), dict):
        return ConfigSection(config["text_config"], "text_config")
    return ConfigSection(config, TOP_LEVEL)


def json_kind(value) -> str:
    """What a JSON value is, for a message."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
