"""A front without API keys answers only requests whose Host names localhost, a loopback address or
a host of --allowed_hosts (http_svc.allowed_hosts: DNS rebinding); with API keys there is no check."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from http_svc.app import HttpFront
from http_svc.config import HttpConfig, parse_config
from specdec.service.api_keys import ApiKeys, key_hash, new_key
from tests.http_svc.conftest import MODEL, FakeGateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
KEY = new_key()


@pytest.fixture
def started(fake_gateway: tuple[FakeGateway, str], request: pytest.FixtureRequest) -> Iterator[TestClient]:
    """A started front; `@pytest.mark.parametrize("started", [{config fields, "api_keys": ...}],
    indirect=True)` sets its HttpConfig fields and API keys."""
    fields = dict(getattr(request, "param", {}))
    api_keys = fields.pop("api_keys", None)
    front = HttpFront(HttpConfig(gateway_address=fake_gateway[1], model_name=MODEL, **fields), api_keys)
    with TestClient(front.app(), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "LocalHost:8000", "localhost.:8000", "127.0.0.1", "127.0.0.1:8000", "127.9.8.7:1"]
    + ["[::1]", "[::1]:8000"],
)
def test_a_loopback_host_is_answered(started: TestClient, fake_gateway: tuple[FakeGateway, str], host: str) -> None:
    assert started.get("/v1/models", headers={"host": host}).status_code == 200
    response = started.post("/v1/chat/completions", json=CHAT, headers={"host": host})
    assert response.status_code == 200, response.text
    assert len(fake_gateway[0].requests) == 1


@pytest.mark.parametrize(
    "host",
    ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", "localhost.attacker.example:8000"]
    + ["testserver", "10.0.0.1:8000", "[::2]:8000", ""],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")]
    + [("GET", "/health"), ("GET", "/metrics"), ("OPTIONS", "/v1/chat/completions"), ("GET", "/nowhere")],
)
def test_another_host_is_a_403_naming_it(
    started: TestClient, fake_gateway: tuple[FakeGateway, str], host: str, method: str, path: str
) -> None:
    """What a page whose site's name re-resolved to 127.0.0.1 sends: refused before any route runs,
    so nothing reaches the gateway and no answer can be read."""
    response = started.request(method, path, json=CHAT if method == "POST" else None, headers={"host": host})
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "host_not_allowed"
    assert repr(host) in error["message"] and "--allowed_hosts" in error["message"]
    assert fake_gateway[0].requests == []


@pytest.mark.parametrize("started", [{"allowed_hosts": ("my-box.lan", "192.168.1.5")}], indirect=True)
def test_a_host_of_allowed_hosts_is_answered(started: TestClient) -> None:
    for host in ("my-box.lan", "MY-BOX.lan:8000", "192.168.1.5:8000", "localhost:8000"):
        assert started.post("/v1/chat/completions", json=CHAT, headers={"host": host}).status_code == 200, host
    assert started.get("/v1/models", headers={"host": "other.lan"}).status_code == 403


@pytest.mark.parametrize("started", [{"allowed_hosts": ("*",)}], indirect=True)
def test_a_star_allows_any_host(started: TestClient) -> None:
    assert started.post("/v1/chat/completions", json=CHAT, headers={"host": "anything.example"}).status_code == 200


@pytest.mark.parametrize(
    "started", [{"api_keys_file": "keys", "api_keys": ApiKeys({key_hash(KEY): "a"})}], indirect=True
)
def test_with_api_keys_any_host_is_answered_with_a_key(started: TestClient) -> None:
    """A page cannot send the user's key: it gets the 401 of any caller without one."""
    assert started.get("/v1/models", headers={"host": "attacker.example"}).status_code == 401
    with_key = {"host": "attacker.example", "authorization": f"Bearer {KEY}"}
    assert started.post("/v1/chat/completions", json=CHAT, headers=with_key).status_code == 200


def test_allowed_hosts_come_from_the_flag_or_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_config([]).allowed_hosts == ()
    assert parse_config(["--allowed_hosts", "a.lan, B.lan,,[::2]"]).allowed_hosts == ("a.lan", "B.lan", "[::2]")
    monkeypatch.setenv("SPECDEC_HTTP_ALLOWED_HOSTS", "c.lan,*")
    assert parse_config([]).allowed_hosts == ("c.lan", "*")


@pytest.mark.parametrize("name", ["http://a.lan", "a.lan:8000", "a lan", "a.lan/x", "-"])
def test_an_allowed_host_with_a_scheme_or_port_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="allowed_hosts"):
        HttpConfig(allowed_hosts=(name,))


def test_a_preflight_is_refused_without_cors_headers(started: TestClient) -> None:
    """No CORS: a preflight from a page of another origin gets no Access-Control-Allow-* header, so
    the browser sends nothing after it (docs/http-api.md)."""
    preflight = {
        "host": "localhost:8000",
        "origin": "https://attacker.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    response = started.options("/v1/chat/completions", headers=preflight)
    assert response.status_code in (403, 405)
    assert not [name for name in response.headers if name.lower().startswith("access-control-")]


@pytest.mark.parametrize("origin", ["https://attacker.example", "http://attacker.example:8000", "null", "x"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_page_of_another_site_is_a_403_naming_its_origin(
    started: TestClient, fake_gateway: tuple[FakeGateway, str], origin: str, path: str
) -> None:
    """What fetch(..., {method: "POST", mode: "no-cors", body: new Blob([json])}) sends from any site:
    a request the browser does not ask about first (no Content-Type, so no 415 either). The gateway
    never sees it."""
    body = json.dumps(CHAT if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "Hi"}).encode()
    response = started.post(path, content=body, headers={"host": "127.0.0.1:8000", "origin": origin})
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "origin_not_allowed"
    assert repr(origin) in error["message"]
    assert fake_gateway[0].requests == []


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:8000", "http://[::1]:3000"])
def test_a_page_of_a_loopback_origin_is_answered(started: TestClient, origin: str) -> None:
    response = started.post("/v1/chat/completions", json=CHAT, headers={"host": "localhost:8000", "origin": origin})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("started", [{"allowed_hosts": ("my-box.lan",)}], indirect=True)
def test_a_page_of_an_allowed_host_is_answered(started: TestClient) -> None:
    headers = {"host": "my-box.lan:8000", "origin": "http://my-box.lan:8000"}
    assert started.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
