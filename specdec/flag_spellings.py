"""Both spellings of every long flag: kebab-case (`--max-new-tokens`, what help shows and the docs
use) and snake_case (`--max_new_tokens`, what scripts, compose files and the launcher already
pass). One function over a built parser, so no flag has to list its alias by hand:

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--max_new_tokens", type=int)
    parser.add_argument("--num-prompts", type=int)
    add_spellings(parser)
    parser.parse_args(["--max-new-tokens", "8", "--num_prompts", "2"])  # both parse, dests unchanged

The destination (`args.max_new_tokens`) never changes; only option strings are added.
"""

from __future__ import annotations

import argparse

LONG_PREFIX = "--"
NEGATION_PREFIX = "--no-"


def other_spelling(option: str) -> str:
    """`--max_new_tokens` <-> `--max-new-tokens` (the prefix kept); a one-word flag is itself."""
    body = option[len(LONG_PREFIX) :]
    if "_" in body:
        return LONG_PREFIX + body.replace("_", "-")
    return LONG_PREFIX + body.replace("-", "_")


def add_spellings(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every long option of `parser` (its groups and subparsers too) its other spelling, kebab
    first so that help and error messages show it. Returns the parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # a subparser's aliases share one parser
                add_spellings(sub)
            continue
        kebab: list[str] = []
        snake: list[str] = []
        for option in action.option_strings:
            if not option.startswith(LONG_PREFIX):
                continue
            alias = other_spelling(option)
            # No `--no_x` for a BooleanOptionalAction's `--no-x`: it reads "off" from the `--no-` prefix
            # alone, so `--no_x` would turn x on. A flag of its own named `--no-x` (store_true) gets both.
            is_snake_negation = (
                isinstance(action, argparse.BooleanOptionalAction)
                and option.startswith(NEGATION_PREFIX)
                and "_" not in option
            )
            if is_snake_negation or alias in parser._option_string_actions:
                continue  # already a flag of its own (or added before)
            parser._option_string_actions[alias] = action
            (kebab if "_" in option else snake).append(alias)
        action.option_strings = [*kebab, *action.option_strings, *snake]
    return parser
