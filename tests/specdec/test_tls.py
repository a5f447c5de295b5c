"""TLS on a service's port (the gateway's --tls_cert/--tls_key): a TLS client is served, a
plaintext one is not; the files go together."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
