"""TLS on a service's port (the gateway's --tls_cert/--tls_key): a TLS client is served, a
plaintext one is not; the files go together."""

from __future__ import annotations

import http.server
import ssl
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import healthcheck
from specdec.service import ServerConfig, create_server
from specdec.service.api_keys import check_tls_files


def test_a_tls_port_serves_tls_clients_only(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    config = ServerConfig(host="localhost", tls_cert_file=str(cert), tls_key_file=str(key))
    server, port = create_server(f"localhost:{config.port}", [], credentials=config.server_credentials())
    server.start()
    try:
        request = health_pb2.HealthCheckRequest()
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"localhost:{port}") as channel, pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_certificate_and_key_go_together() -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        ServerConfig(tls_cert_file="cert.pem")
    assert ServerConfig().server_credentials() is None and not ServerConfig().is_tls


def test_tls_files_are_checked_while_the_flags_are_parsed(certificate: tuple[Path, Path], tmp_path: Path) -> None:
    cert, key = (str(path) for path in certificate)
    check_tls_files(cert, key, cert)
    check_tls_files("", "")
    with pytest.raises(ValueError, match="--tls_cert '/nonexistent.pem'.*No such file"):
        check_tls_files("/nonexistent.pem", key)
    with pytest.raises(ValueError, match=f"--tls_cert '{key}'"):
        check_tls_files(key, cert)  # swapped
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="--gateway_ca_file"):
        check_tls_files("", "", str(garbage))


def test_the_healthcheck_command_checks_a_tls_server_over_tls(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server with --tls_cert (compose's gateway once TLS is on) was checked in plaintext only, so
    it never turned healthy and what depends on it never started."""
    cert, key = certificate
    config = ServerConfig(host="127.0.0.1", tls_cert_file=str(cert), tls_key_file=str(key))
    server, port = create_server(f"127.0.0.1:{config.port}", [], credentials=config.server_credentials())
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert healthcheck.main([address, "--timeout", "1"]) == 1  # plaintext: refused
        assert healthcheck.main([address, "--tls_ca_file", str(cert)]) == 0
        assert healthcheck.main([address, "--tls_ca_file", str(cert), "--tls_server_name", "localhost"]) == 0
        assert healthcheck.main([address, "--tls-ca-file", str(cert), "--tls_server_name", "other.example"]) == 1
        monkeypatch.setenv(healthcheck.CA_FILE_VARIABLE, str(cert))  # the container's variable, its command unchanged
        assert healthcheck.main([address]) == 0
    finally:
        server.stop(None)


def test_the_healthcheck_command_checks_an_https_server(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{httpd.server_address[1]}"
    try:
        assert healthcheck.main([address, "--http_path", "/health", "--tls_ca_file", str(cert)]) == 0
        assert healthcheck.main([address, "--http_path", "/down", "--tls_ca_file", str(cert)]) == 1
        named = ["--tls_ca_file", str(cert), "--tls_server_name"]
        assert healthcheck.main([address, "--http_path", "/health", *named, "localhost"]) == 0
        assert healthcheck.main([address, "--http_path", "/health", *named, "other.example"]) == 1
        assert healthcheck.main([address, "--http_path", "/health", "--timeout", "1"]) == 1  # plaintext
    finally:
        httpd.shutdown()
        httpd.server_close()
