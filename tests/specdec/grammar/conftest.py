"""Grammar test data; the tokenizer and grammar fixtures are in tests/conftest.py."""

from __future__ import annotations

import json

# A tiny schema whose forced text is easy to write down by hand: keys in declared order, all
# required, compact separators ", " and ": ".
PERSON_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["name", "age", "unit"],
    }
)
