"""The `specdec` command of the installed package: one entry point for the three things a user runs.

    specdec serve [FLAGS]      the services + the OpenAI-compatible HTTP API (= inference.py --serve)
    specdec generate [FLAGS]   one request through freshly started services (= inference.py)
    specdec bench [ARGS]       the benchmark suite or one component benchmark (= python -m bench)

Each subcommand hands its arguments, untouched, to the command line it stands for, so every flag,
help text and exit code is that command's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

USAGE = """usage: specdec {serve,generate,bench} [ARGS...]

  serve      start the services and the OpenAI-compatible HTTP API; Ctrl-C stops
             (specdec serve --help; e.g. specdec serve --http-port 8000)
  generate   start the services, run one request, print the text and stop
             (specdec generate --help; e.g. specdec generate --prompt "Hello")
  bench      run the benchmark suite, or one part (specdec bench --help; specdec bench engine)
"""
EXIT_BAD_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr, end="")
        return 0 if args else EXIT_BAD_USAGE
    command, rest = args[0], args[1:]
    if command in ("serve", "generate"):
        import inference  # the services' start-up imports grpc and the stubs: only when asked

        flags = ["--serve", *rest] if command == "serve" else rest
        return inference.main(flags, prog=f"specdec {command}")
    if command == "bench":
        from bench.__main__ import main as bench_main

        sys.argv = ["specdec bench", *rest]  # the benchmarks read their own argv
        bench_main()
        return 0
    print(f"specdec: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return EXIT_BAD_USAGE


def run() -> None:
    """The console script's entry point (pyproject.toml [project.scripts])."""
    try:
        sys.exit(main())
    except BrokenPipeError:
        # stdout closed early (`| head`): quiet the interpreter's final flush, as inference.py does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
