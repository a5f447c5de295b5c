"""The checks a frozen config or a decoded record runs in its `__post_init__`, each raising one
ValueError that names the field (the services turn it into INVALID_ARGUMENT with that message)."""

from __future__ import annotations


def require_at_least_one(record: object, *names: str, prefix: str = "") -> None:
    """ValueError for the first of `names` whose value on `record` is below 1:
    "{prefix}{name} must be >= 1, got {value}"."""
    for name in names:
        value = getattr(record, name)
        if value < 1:
            raise ValueError(f"{prefix}{name} must be >= 1, got {value}")


def require_counts(record: object, *names: str) -> None:
    """As `require_at_least_one` for fields that may hold anything (a record built from the wire):
    each must be an int >= 1, and a bool is not one."""
    for name in names:
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def require_bytes(record: object, name: str) -> None:
    """ValueError unless the field `name` of `record` holds bytes (a payload built from the wire)."""
    value = getattr(record, name)
    if not isinstance(value, bytes):
        raise ValueError(f"{name} must be bytes, got {type(value).__name__}")
