"""Container health check: `python -m specdec.healthcheck ADDRESS [--service NAME | --http_path PATH]
[--tls_ca_file PEM [--tls_server_name NAME]]`.

Exits 0 when the gRPC server at ADDRESS reports SERVING (grpc.health.v1), or,
with --http_path, when GET http://ADDRESS/PATH answers 200 (the HTTP front);
1 otherwise. Stands in for grpc_health_probe, which the image does not ship.

A server that serves TLS (the gateway's --tls_cert, the HTTP front's) is checked over TLS with
--tls_ca_file: its certificate is verified against those PEM roots (the certificate itself when it
is self-signed) for --tls_server_name (default: ADDRESS's host; a check on 127.0.0.1 names the host
the certificate was issued for). Both default to SPECDEC_HEALTHCHECK_TLS_CA_FILE and
SPECDEC_HEALTHCHECK_TLS_SERVER_NAME, so a container that turns TLS on sets them beside its
certificate and keeps its health check's command.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import sys

import grpc

from specdec.service.health import check_health
from specdec.flag_spellings import add_spellings

CA_FILE_VARIABLE, SERVER_NAME_VARIABLE = "SPECDEC_HEALTHCHECK_TLS_CA_FILE", "SPECDEC_HEALTHCHECK_TLS_SERVER_NAME"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.http_path and args.tls_ca_file:
        is_serving = _is_https_healthy(
            args.address, args.http_path, args.tls_ca_file, args.tls_server_name, args.timeout
        )
    elif args.http_path:
        from specdec.launcher import is_http_healthy

        is_serving = is_http_healthy(f"http://{args.address}{args.http_path}", timeout_s=args.timeout)
    else:
        with _channel(args.address, args.tls_ca_file, args.tls_server_name) as channel:
            is_serving = check_health(channel, args.service, timeout_s=args.timeout)
    print("SERVING" if is_serving else "NOT_SERVING", file=sys.stderr)
    return 0 if is_serving else 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="service name to check; empty means the whole server")
    parser.add_argument("--http_path", default="", help="an HTTP server: GET this path must answer 200")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    parser.add_argument(
        "--tls_ca_file",
        default=os.environ.get(CA_FILE_VARIABLE, ""),
        help=f"the server serves TLS: verify it against these PEM roots (${CA_FILE_VARIABLE})",
    )
    parser.add_argument(
        "--tls_server_name",
        default=os.environ.get(SERVER_NAME_VARIABLE, ""),
        help=f"the name its certificate must carry (${SERVER_NAME_VARIABLE}; default: the address's host)",
    )
    args = add_spellings(parser).parse_args(argv)
    # Refused here (exit 2, one line): a path without its "/" made a URL whose port swallowed it, and
    # urllib's InvalidURL came out as a traceback; a timeout <= 0 could never see an answer.
    if args.http_path and not args.http_path.startswith("/"):
        parser.error(f"--http_path must start with '/', got {args.http_path!r}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.tls_server_name and not args.tls_ca_file:
        parser.error("--tls_server_name: a name to check a certificate against needs --tls_ca_file")
    if args.tls_ca_file and not os.path.isfile(args.tls_ca_file):
        parser.error(f"--tls_ca_file: no file at {args.tls_ca_file!r}")
    return args


def _channel(address: str, ca_file: str, server_name: str) -> grpc.Channel:
    if not ca_file:
        return grpc.insecure_channel(address)
    with open(ca_file, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def _is_https_healthy(address: str, path: str, ca_file: str, server_name: str, timeout_s: float) -> bool:
    """GET https://address/path answers 200, the certificate verified for `server_name` (default:
    the address's host)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    name = server_name or host
    try:
        context = ssl.create_default_context(cafile=ca_file)
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=name) as tls:
                tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode("ascii"))
                status_line = tls.makefile("rb").readline()
    except (OSError, ValueError, UnicodeError):  # ssl.SSLError is an OSError
        return False
    return status_line.split()[1:2] == [b"200"]


if __name__ == "__main__":
    raise SystemExit(main())
