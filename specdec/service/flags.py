"""Command-line flags whose defaults come from the environment: one way for every service.

    flags = Flags(argparse.ArgumentParser(prog="python -m gateway"), "GATEWAY", os.environ)
    flags.add("--port", 50050)                    # SPECDEC_GATEWAY_PORT, else SPECDEC_PORT, else 50050
    flags.add("--num_threads", 1, shared=False)   # SPECDEC_GATEWAY_NUM_THREADS only
    flags.add("--adaptive", True)                 # --adaptive / --no-adaptive; the variable: true|false
    a = flags.parser.parse_args(argv)

A flag's variable is its name upper-cased (`--max_batch` -> MAX_BATCH), looked up first with the
service's own prefix, then (unless `shared=False`) with the plain SPECDEC_ prefix that compose sets
for every service. The flag parses what the default's type says (int, float, str; a bool reads
1/true/yes/on and 0/false/no/off). A variable that does not parse is a ValueError naming the
variable and the flag, raised while the parser is built: a bad deployment stops at start-up and
says which variable to fix.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    """An argparse type: ArgumentTypeError, whose message argparse shows as it is."""
    value = text.strip().lower()
    if value not in TRUE + FALSE:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in TRUE


class Flags:
    """One service's parser and environment. `service`: its prefix (GATEWAY -> SPECDEC_GATEWAY_*)."""

    def __init__(self, parser: argparse.ArgumentParser, service: str, environ: Mapping[str, str]) -> None:
        self.parser = parser
        self.service = service
        self._environ = environ

    def variables(self, name: str, *, shared: bool = True) -> tuple[str, ...]:
        """The variables that set `name`, first found wins."""
        own = f"SPECDEC_{self.service}_{name}"
        return (own, f"SPECDEC_{name}") if shared else (own,)

    def env(self, names: str | tuple[str, ...], *, shared: bool = True) -> tuple[str, str] | None:
        """(variable, text) of the first variable set among those of `names`, in order; None if none is."""
        for name in (names,) if isinstance(names, str) else names:
            for variable in self.variables(name, shared=shared):
                if variable in self._environ:
                    return variable, self._environ[variable]
        return None

    def add(
        self,
        flag: str,
        default: Any,
        *aliases: str,
        env: str | tuple[str, ...] | None = None,
        shared: bool = True,
        type: Callable[[str], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """An option whose default is its variable's value when set, else `default`.

        `env`: the variable's name(s) when not the flag's own. `type`: the parser when the default
        does not say (a None default). A bool flag is --x/--no-x unless `action` or `nargs` is given."""
        parse = type or _parser_of(default)
        found = self.env(env or flag.lstrip("-").upper(), shared=shared)
        if found is not None:
            variable, text = found
            try:
                default = parse(text)
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{variable} (the default of {flag}): {e}") from None
            if "choices" in kwargs and default not in kwargs["choices"]:
                raise ValueError(f"{variable} (the default of {flag}) must be one of {kwargs['choices']}, got {text!r}")
        if parse is parse_bool and "nargs" not in kwargs:
            kwargs.setdefault("action", argparse.BooleanOptionalAction)
        else:
            kwargs["type"] = parse
        self.parser.add_argument(flag, *aliases, default=default, **kwargs)


def _parser_of(default: Any) -> Callable[[str], Any]:
    if isinstance(default, bool):  # before int: a bool is an int
        return parse_bool
    if isinstance(default, (int, float, str)):
        return type(default)
    raise TypeError(f"give the type of a flag whose default is {default!r}")
