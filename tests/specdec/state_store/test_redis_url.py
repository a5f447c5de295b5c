"""--redis_url: one server, a Redis Cluster or Sentinel, parsed and checked in one place
(specdec.state_store.redis_url); a malformed URL names the flag, never shows a password."""

from __future__ import annotations

import pytest

from specdec.state_store.redis_url import RedisKind, RedisTarget, parse_redis_url, redacted_url


def test_a_single_server_url_passes_through_to_redis_py() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@cache.internal:6380", "unix:///tmp/r.sock"):
        target = parse_redis_url(url)
        assert (target.kind, target.url, target.nodes) == (RedisKind.SINGLE, url, ())
    assert parse_redis_url("rediss://h:1").is_tls


def test_a_cluster_url_lists_its_seed_nodes() -> None:
    target = parse_redis_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001, [::1]:7002")
    assert target == RedisTarget(
        RedisKind.CLUSTER,
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7001, [::1]:7002",
        (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)),
    )
    secure = parse_redis_url("rediss+cluster://app:s%40cret@h:7000")
    assert (secure.is_tls, secure.username, secure.password, secure.nodes) == (True, "app", "s@cret", (("h", 7000),))
    assert parse_redis_url("redis+cluster://:pw@h:7000").password == "pw"


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_db() -> None:
    target = parse_redis_url("redis+sentinel://s1:26379,s2:26380/mymaster/2")
    assert (target.kind, target.nodes) == (RedisKind.SENTINEL, (("s1", 26379), ("s2", 26380)))
    assert (target.service_name, target.db, target.is_tls) == ("mymaster", 2, False)
    assert parse_redis_url("rediss+sentinel://s1:26379/mymaster").db == 0


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("127.0.0.1:6379", "has no scheme"),
        ("memcached://h:1", "unknown scheme"),
        ("redis://", "names no host"),
        ("redis+cluster://h", "is not host:port"),
        ("redis+cluster://h:0", "no port in 1..65535"),
        ("redis+cluster://h:70000", "no port in 1..65535"),
        ("redis+cluster://h:7\u00b2", "no port in 1..65535"),  # isdigit() but not int(): a bare ValueError before
        ("redis+cluster://h:7000,", "is not host:port"),
        ("redis+cluster://h:7000/0", "takes no path"),
        ("redis+cluster://h:7000?timeout=1", "no query"),
        ("redis+sentinel://s:26379", "names no service"),
        ("redis+sentinel://s:26379/", "names no service"),
        ("redis+sentinel://s:26379/m/x", "db that is not a number"),
        ("redis+sentinel://s:26379/m/\u00b9", "db that is not a number"),
        ("redis+sentinel://s:26379/m/1/2", "path past"),
    ],
)
def test_a_malformed_url_names_the_flag(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"--redis_url .*{why}"):
        parse_redis_url(url)


def test_an_error_does_not_show_the_password() -> None:
    with pytest.raises(ValueError) as info:
        parse_redis_url("redis+cluster://app:hunter2@h")
    assert "hunter2" not in str(info.value) and "app:***@h" in str(info.value)


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://app:hun/ter2@h:7000", "redis+sentinel://:hun/ter2@s:26379/m", "redis://:hun/ter2@h:6379/0"],
)
def test_a_password_with_an_unencoded_slash_is_refused_without_showing_it(url: str) -> None:
    """The '/' ends the netloc early: the cut password was parsed as a node ("node 'app:hun'") and the
    redaction, which looked for the '@' before the first '/', found none and showed the whole URL. For
    a single server the URL went on to redis-py, whose error showed part of it too."""
    with pytest.raises(ValueError, match="%2F") as info:
        parse_redis_url(url)
    assert "hun" not in str(info.value) and "ter2" not in str(info.value)


def test_an_at_sign_in_a_query_is_no_cut_password_and_a_query_password_is_redacted() -> None:
    """Only an '@' before the query marks a password cut at its '/': redis-py's single-server URLs
    take options in the query, whose values may hold one. Its password= option is redacted too."""
    url = "rediss://h:6380/0?ssl_ca_certs=/etc/ssl/ca@corp.pem"
    assert parse_redis_url(url).kind is RedisKind.SINGLE
    assert redacted_url(url) == url
    assert redacted_url("redis://h:6379/0?password=hunter2&db=1") == "redis://h:6379/0?password=***&db=1"
    assert redacted_url("redis://app:hun/ter2@h:6379/0?db=1") == "redis://app:***@h:6379/0?db=1"
    assert redacted_url("redis+cluster://app:hun?ter2@h:7000") == "redis+cluster://app:***@h:7000"
