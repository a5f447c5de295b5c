"""Container health check: `python -m specdec.healthcheck ADDRESS [--service NAME | --http_path PATH]`.

Exits 0 when the gRPC server at ADDRESS reports SERVING (grpc.health.v1), or,
with --http_path, when GET http://ADDRESS/PATH answers 200 (the HTTP front);
1 otherwise. Stands in for grpc_health_probe, which the image does not ship.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from specdec.service.health import check_health
from specdec.flag_spellings import add_spellings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="service name to check; empty means the whole server")
    parser.add_argument("--http_path", default="", help="an HTTP server: GET this path must answer 200")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = add_spellings(parser).parse_args(argv)
    # Refused here (exit 2, one line): a path without its "/" made a URL whose port swallowed it, and
    # urllib's InvalidURL came out as a traceback; a timeout <= 0 could never see an answer.
    if args.http_path and not args.http_path.startswith("/"):
        parser.error(f"--http_path must start with '/', got {args.http_path!r}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.http_path:
        from specdec.launcher import is_http_healthy

        is_serving = is_http_healthy(f"http://{args.address}{args.http_path}", timeout_s=args.timeout)
    else:
        with grpc.insecure_channel(args.address) as channel:
            is_serving = check_health(channel, args.service, timeout_s=args.timeout)
    print("SERVING" if is_serving else "NOT_SERVING", file=sys.stderr)
    return 0 if is_serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
