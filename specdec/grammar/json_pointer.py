"""Local `$ref`s of a schema ("#", "#/$defs/Place"): JSON pointers (RFC 6901) in a URI fragment.

One implementation for every place that follows or writes them: the compiler's checks (which
schema a `$ref` reaches) and the tools' calls schema (where a tool's parameters sit in it). It
reads them as the grammar engine and `jsonschema` do: the fragment is percent-decoded first, then
split at "/", then in each token "~1" is "/" and "~0" is "~" (in that order: "~01" is "~1"); a
token steps into an object by key (the empty key too) and into an array by decimal index.
"""

from __future__ import annotations

import re
import urllib.parse

_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")  # RFC 6901: no leading zeros, no sign


def is_local(ref: object) -> bool:
    """Whether `ref` is a pointer into its own document: "#" or "#/..."."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def pointer(ref: str) -> str:
    """The JSON pointer of a local `$ref` ("" for "#"), percent-decoded, as an error names a place."""
    return urllib.parse.unquote(ref[1:])


def escape(name: str) -> str:
    """`name` as one pointer token ("a/b" is "a~1b")."""
    return name.replace("~", "~0").replace("/", "~1")


def join(base: str, *names: str | int) -> str:
    """The pointer `base` ("" for the root) followed by `names`, each escaped."""
    return base + "".join("/" + escape(str(name)) for name in names)


def resolve(root: object, ref: object) -> object:
    """What a local `$ref` points at in `root`, or None when it is not local or points at nothing."""
    if not is_local(ref):
        return None
    assert isinstance(ref, str)
    target = root
    for token in pointer(ref).split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict):
            target = target.get(token)
        elif isinstance(target, list) and _INDEX.match(token) and int(token) < len(target):
            target = target[int(token)]
        else:
            return None
    return target


def rebased(ref: str, at: str) -> str:
    """A local `$ref` of a schema that now sits at pointer `at` of a larger one, pointing to the same
    place there ("#/$defs/A" at "/items" is "#/items/$defs/A"); `ref` unchanged when not local."""
    return f"#{at}{ref[1:]}" if is_local(ref) else ref
