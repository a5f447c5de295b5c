"""The state store's --redis_url, parsed and checked in one place for the gateway and every tool.

Three deployments of Redis, one flag:

    redis://[user:password@]host:port/db, rediss://..., unix:///path/to.sock
        one server (redis-py's own URL syntax, passed through to from_url)
    redis+cluster://[user:password@]host:port[,host:port...]        (rediss+cluster: TLS)
        Redis Cluster: the seed nodes; the client discovers the rest (CLUSTER SLOTS) and
        follows MOVED/ASK and failovers. A cluster has one database, so no /db.
    redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]  (rediss+sentinel)
        a master watched by Sentinel: the sentinels' addresses and the master's service name;
        the client asks the sentinels for the current master after every failover.

user:password authenticate to the Redis data nodes (the sentinels themselves are asked without).
E.g. redis+cluster://10.0.0.1:7000,10.0.0.2:7000 or redis+sentinel://s1:26379,s2:26379/mymaster/0.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from urllib.parse import unquote

FLAG = "--redis_url"
SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_MAX_PORT = 65535


class RedisKind(enum.StrEnum):
    SINGLE = "single"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the state store lives. url: the flag as given (single: what redis-py's from_url
    takes). nodes: cluster seed nodes or sentinels, (host, port) each; empty for SINGLE."""

    kind: RedisKind
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str = ""  # SENTINEL: the master's name in the sentinels' configuration
    db: int = 0  # SENTINEL: the database on the master
    is_tls: bool = False
    username: str | None = None
    password: str | None = None


def parse_redis_url(url: str) -> RedisTarget:
    """The RedisTarget of url; ValueError naming --redis_url when it is malformed.

    E.g. "redis+sentinel://a:26379,b:26379/mymaster/2" ->
    RedisTarget(SENTINEL, nodes=(("a", 26379), ("b", 26379)), service_name="mymaster", db=2)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise _bad(url, "has no scheme (redis://, rediss://, unix://, redis+cluster://, redis+sentinel://)")
    scheme = scheme.lower()
    if scheme not in SINGLE_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        raise _bad(url, f"has the unknown scheme {scheme!r}")
    netloc, _, path = rest.partition("/")
    if scheme != "unix" and _is_cut_at_slash(rest):
        raise _bad(url, "has an '@' after a '/': write a '/' in the user or password as %2F")
    if scheme in SINGLE_SCHEMES:
        if scheme != "unix" and not netloc.rpartition("@")[2]:
            raise _bad(url, "names no host")
        return RedisTarget(RedisKind.SINGLE, url, is_tls=scheme == "rediss")
    if "?" in rest or "#" in rest:
        raise _bad(url, "takes no query or fragment for a cluster or sentinel URL")
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(url, userinfo) if at else (None, None)
    nodes = tuple(_node(url, item) for item in hosts.split(","))
    is_tls = scheme.startswith("rediss")
    if scheme in CLUSTER_SCHEMES:
        if path:
            raise _bad(url, "takes no path: a Redis Cluster has one database")
        return RedisTarget(RedisKind.CLUSTER, url, nodes, is_tls=is_tls, username=username, password=password)
    service_name, db = _service_and_db(url, path)
    return RedisTarget(
        RedisKind.SENTINEL, url, nodes, service_name, db, is_tls=is_tls, username=username, password=password
    )


def _credentials(url: str, userinfo: str) -> tuple[str | None, str | None]:
    username, colon, password = userinfo.partition(":")
    if not colon:  # redis-py's convention: a lone word is the password
        username, password = "", username
    return unquote(username) or None, unquote(password) or None


def _node(url: str, item: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[::1]:port"."""
    host, colon, port_text = item.strip().rpartition(":")
    if not colon or not host:
        raise _bad(url, f"node {item!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= _MAX_PORT:
        raise _bad(url, f"node {item!r} has no port in 1..{_MAX_PORT}")
    return host, int(port_text)


def _service_and_db(url: str, path: str) -> tuple[str, int]:
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise _bad(url, "names no service: redis+sentinel://host:port[,host:port]/service_name[/db]")
    if len(parts) > 2 or (len(parts) == 2 and not (parts[1].isascii() and parts[1].isdigit())):
        raise _bad(url, "has a path past /service_name/db, or a db that is not a number >= 0")
    return unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"{FLAG} {redacted_url(url)!r} {why}")


def _is_cut_at_slash(rest: str) -> bool:
    """Whether the URL after its scheme has an '@' past the first '/' (and before any query) but none
    before it: "user:pa/ss@host", a password whose '/' ended the netloc early."""
    head = re.split(r"[?#]", rest, maxsplit=1)[0]
    netloc, _, path = head.partition("/")
    return "@" in path and "@" not in netloc


def redacted_url(url: str) -> str:
    """url without its password, for error messages, logs and what a tool prints: the user info, up
    to the last '@' before the first '/' (a '?' or '#' in a password does not end it here), or, where
    a '/' in the password cut the netloc (_is_cut_at_slash), up to the last '@' before any query; and
    a password= query option (redis-py's URLs take one)."""
    scheme, sep, rest = url.partition("://")
    end = rest.partition("/")[0].rfind("@")
    if end < 0 and _is_cut_at_slash(rest):
        end = re.split(r"[?#]", rest, maxsplit=1)[0].rfind("@")
    tail = re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", rest[max(end, 0) :])
    if end < 0:
        return f"{scheme}{sep}{tail}"
    user = rest[:end].partition(":")[0] if ":" in rest[:end] else ""
    return f"{scheme}{sep}{user}:***{tail}"
