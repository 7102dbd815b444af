"""Every subcommand's --help shows each option's default."""

from __future__ import annotations

import argparse
import pytest

from apps import generate, inspect, preflight, report
from pipelines import options
from prepack.cli_help import DefaultsHelpFormatter
from train import cli as train_cli

PARSERS = {
    "pack": options.build_parser, "inspect": inspect.build_parser, "preflight": preflight._parser,
    "report": report._parser, "train": train_cli.build_parser, "generate": generate.build_parser,
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_every_default(name):
    parser = PARSERS[name]()
    assert parser.formatter_class is DefaultsHelpFormatter
    for action in parser._actions:  # noqa: SLF001
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS, []):
            continue
        formatter = parser._get_formatter()  # noqa: SLF001  (the help of this one option, as --help prints it)
        formatter.add_argument(action)
        entry = " ".join(formatter.format_help().split())
        assert "default" in entry, f"prepack {name} --help: {action.option_strings[-1]} does not show its default: {entry}"


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_never_shows_an_empty_list_default(name):
    assert "(default: [])" not in PARSERS[name]().format_help()


def test_preflight_and_pack_help_list_the_format_names():
    for name in ("pack", "preflight"):
        text = " ".join(PARSERS[name]().format_help().split())
        from prepack.text.formats import template_names

        assert ", ".join(template_names()) + ", or auto" in text, name


def test_train_help_names_the_defaults_a_newcomer_asks_for():
    text = " ".join(train_cli.build_parser().format_help().split())
    for shown in ("(default: tiny)", "(default: 8)", "(default: 100)", "(default: bf16 real, f32 tiny)"):
        assert shown in text
