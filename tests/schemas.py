"""JSON schemas the grammar tests constrain outputs with, as the JSON text a request carries."""

from __future__ import annotations

import json

# Keys in declared order, all required: its forced text (compact separators ", " and ": ") is easy to
# write down by hand, and the enum gives a run of tokens the grammar alone decides.
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

# The person without the enum: a name and an age, both required.
NAME_AGE_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)
