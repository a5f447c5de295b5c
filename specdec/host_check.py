"""The Host rule of a listener that answers without authentication, the defence against DNS
rebinding: the keyless HTTP front (http_svc.allowed_hosts) and every service's --metrics_port.

A web page can make its own site's name resolve to 127.0.0.1 (or to a private address) and then
read the answers of a listener there as its own (same origin); its requests still name that site
in their Host header. So such a listener answers a Host that names localhost, a loopback address
or one of its allowed hosts ("*" among them: any), and refuses others. A Host that is an IP
address cannot come from such a page (a browser sends the host of the page's own URL, and a page
whose URL is this listener's address is served by this listener), which is what lets a listener
that only reads (the /metrics endpoint) also pass those: a scraper names its target's address.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Iterable

# An allowed-hosts entry that allows every host (the check off).
ANY_HOST = "*"
_HOST_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (public listeners need API keys otherwise)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve to anything


def is_ip_address(host: str) -> bool:
    """Whether `host` (as host_of gives it: no port, no brackets) is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def host_of(authority: str) -> str:
    """The host of a Host header's value, lower case, without its port, an IPv6 address's brackets
    or a trailing dot: "LocalHost:8000" -> "localhost", "[::1]:8000" -> "::1"."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        end = authority.find("]")
        return authority[1:end] if end > 0 else authority
    return authority.partition(":")[0].removesuffix(".")


def origin_host(origin: str) -> str:
    """The host of an Origin header's value ("http://LocalHost:3000" -> "localhost"); "" for "null"
    or one that does not parse."""
    try:
        # hostname: lower case, an IPv6 address without its brackets, as host_of gives a Host's.
        return (urllib.parse.urlsplit(origin.strip()).hostname or "").removesuffix(".")
    except ValueError:
        return ""


def is_host_name(name: str) -> bool:
    """Whether an allowed-hosts entry is a host name or an IP address (no scheme, no port)."""
    if is_loopback(name) or _HOST_NAME.match(name.lower().removesuffix(".")):
        return True
    return is_ip_address(name.strip("[]"))


def check_allowed_hosts(names: Iterable[str], flag: str = "allowed_hosts") -> None:
    """A ValueError naming `flag` for an entry that is neither a host name, an IP address nor "*"."""
    for name in names:
        if name != ANY_HOST and not is_host_name(name):
            raise ValueError(
                f"{flag}: {name!r} is not a host name or IP address (no scheme, no port; {ANY_HOST!r} allows any host)"
            )


def allowed_host_set(names: Iterable[str]) -> frozenset[str]:
    """The hosts of allowed-hosts entries as host_of gives a Host's ("*" stays "*")."""
    return frozenset(host_of(name) for name in names)


def is_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a listener with these allowed hosts (allowed_host_set) answers `host`."""
    return ANY_HOST in allowed or host in allowed or is_loopback(host)
