"""Each command-line flag declared once: name, type, default, help, environment variable, choices,
and the config field it sets. A service's config.py lists its flags; the argparse parser (through
specdec.service.flags, which reads the environment) and the values of its frozen config dataclasses
both come from that one list:

    FLAGS = (
        Flag("--port", 50051, group="server"),           # ServerConfig.port
        Flag("--max_batch", help="verify items ..."),     # default: PrimaryConfig.max_batch
        Flag("--no_shared_weights", env="SHARED_WEIGHTS", dest="shared_weights",
             field="is_shared_weights", action="store_false"),
    )
    a = parse_flags("PRIMARY", os.environ, FLAGS, {"": PrimaryConfig, "server": ServerConfig}, parser, argv)
    PrimaryConfig(server=ServerConfig(**values(a, FLAGS, "server")), **values(a, FLAGS))

A flag without a default takes its config field's default, so a default is written in one place.
Both spellings of every flag (--max_batch, --max-batch) parse (specdec.flag_spellings).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from specdec.flag_spellings import add_spellings
from specdec.logging import LOG_LEVELS
from specdec.service.flags import Flags


class _FromConfig:
    """The sentinel of a flag whose default is its config field's default."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG: Any = _FromConfig()
# The group of a flag that sets no config field directly: its parse function reads it.
NO_FIELD = None
# argparse's exit status for a bad flag: a bad variable, or a value a config refuses, exits the same.
EXIT_BAD_CONFIG = 2

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag. `group`: which config dataclass its field belongs to ("" the service's own, or a
    nested one such as "server"; NO_FIELD: read by the parse function). `field`: that field's name
    (default: the flag's destination). `convert`: parsed value -> field value (a comma list to a
    tuple, a path to Path). `options`: further argparse keywords (action, dest, nargs, const...)."""

    name: str
    default: Any = FROM_CONFIG
    help: str | None = None
    env: str | tuple[str, ...] | None = None
    is_shared: bool = True  # also read SPECDEC_<NAME>, which compose sets for every service
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    group: str | None = ""
    field: str | None = None
    convert: Callable[[Any], Any] | None = None
    aliases: tuple[str, ...] = ()
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dest(self) -> str:
        return str(self.options.get("dest", self.name.lstrip("-")))

    @property
    def field_name(self) -> str:
        return self.field or self.dest


def default_of(declared: Flag, configs: Mapping[str, type]) -> Any:
    """The flag's own default, else its config field's."""
    if declared.default is not FROM_CONFIG:
        return declared.default
    assert declared.group is not NO_FIELD, f"{declared.name} sets no field: give its default"
    fields = {f.name: f for f in dataclasses.fields(configs[declared.group])}
    field = fields[declared.field_name]
    assert field.default is not dataclasses.MISSING, f"{declared.name}: {declared.field_name} has no default"
    return field.default


def add_flags(flags: Flags, declared: Sequence[Flag], configs: Mapping[str, type]) -> None:
    """Add every declared flag to `flags`' parser, in order, its default from the environment first."""
    for f in declared:
        kwargs = dict(f.options)
        if f.help is not None:
            kwargs["help"] = f.help
        if f.choices is not None:
            kwargs["choices"] = f.choices
        flags.add(f.name, default_of(f, configs), *f.aliases, env=f.env, shared=f.is_shared, type=f.type, **kwargs)


def parse_flags(
    service: str,
    environ: Mapping[str, str],
    declared: Sequence[Flag],
    configs: Mapping[str, type],
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
) -> argparse.Namespace:
    """Parse argv against the declared flags (SPECDEC_<SERVICE>_* variables as defaults)."""
    add_flags(Flags(parser, service, environ), declared, configs)
    return add_spellings(parser).parse_args(argv)


def values(args: argparse.Namespace, declared: Sequence[Flag], group: str = "") -> dict[str, Any]:
    """The config fields of `group` that the parsed flags set, each value converted for its field."""
    out: dict[str, Any] = {}
    for f in declared:
        if f.group != group or f.group is NO_FIELD:
            continue
        value = getattr(args, f.dest)
        out[f.field_name] = f.convert(value) if f.convert is not None else value
    return out


# The most torch threads a service takes (--num_threads): above the hardware threads of any one
# machine; far more (a typo's 100000) made libgomp's thread creation fail at the first product, which
# aborts the process, and a negative count made torch raise at start-up: a traceback, not a refusal.
MAX_NUM_THREADS = 1024


def check_num_threads(value: int, name: str = "num_threads") -> None:
    """A service's torch thread count: 0 (torch's default) to MAX_NUM_THREADS."""
    if not 0 <= value <= MAX_NUM_THREADS:
        raise ValueError(f"{name} must be in [0, {MAX_NUM_THREADS}] (0: torch's default), got {value}")


def listen_flags(port: int) -> tuple[Flag, ...]:
    """--host, --port (this service's default), --metrics_port and --allowed_hosts: the fields of a
    service's ServerConfig (specdec.service.server), in the config group "server"."""
    return (
        Flag("--host", group="server"),
        Flag("--port", port, group="server"),
        Flag("--metrics_port", group="server"),
        Flag(
            "--allowed_hosts",
            "",
            type=str,
            convert=names,
            group="server",
            help="the host names (comma-separated) that a /metrics request's Host header may name besides "
            "localhost, loopback addresses and IP addresses; others get 403, which keeps web pages from "
            "reading the counters through DNS rebinding ('*': any host)",
        ),
    )


def log_level_flag() -> Flag:
    """--log_level, one of specdec.logging.LOG_LEVELS in any case: a bad one, on the command line or
    in SPECDEC_LOG_LEVEL, is refused while parsing (one line, EXIT_BAD_CONFIG) rather than by the
    logging set-up after it (a traceback)."""
    return Flag("--log_level", type=str.upper, choices=LOG_LEVELS)


def model_path_flag(help: str | None = None, group: str | None = "") -> Flag:
    """--model_path, also read from MODEL_PATH or MODEL: an HF model directory or a .gguf file; unset
    or "": the default model (SmolLM2-135M-Instruct)."""
    return Flag("--model_path", None, env=("MODEL_PATH", "MODEL"), type=str, help=help, group=group, convert=optional)


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list flag's value: `a, b,,c` -> ("a", "b", "c")."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def optional(text: str | None) -> str | None:
    """An optional text flag's value: "" means unset."""
    return text or None


def config_or_exit(prog: str, parse: Callable[..., T], *args: Any) -> T:
    """parse(*args): a service's config from its flags and environment. A ValueError (a variable that
    does not parse, a value the config refuses) is one line naming it and EXIT_BAD_CONFIG, as argparse
    reports a bad flag: a traceback would bury the message in the service's log."""
    try:
        return parse(*args)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_CONFIG) from None
