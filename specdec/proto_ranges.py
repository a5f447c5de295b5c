"""The ranges of the protobuf scalar types that carry numbers a user gives, declared once.

The edges that read numbers from users (the command line, the HTTP front) check them against these
before a request message is built, so a value out of range is a bad flag or an HTTP 400 naming the
field, not a ValueError from protobuf; the state store keeps token ids as the wire carries them.
"""

from __future__ import annotations

MAX_INT32 = 2**31 - 1  # top_k; every token id (repeated int32 on the wire)
MAX_UINT32 = 2**32 - 1  # counts: max_new_tokens, min_tokens, ...
MAX_UINT64 = 2**64 - 1  # a sampling seed
MAX_TOKEN_ID = MAX_INT32
