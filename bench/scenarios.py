"""The scenarios of `python -m bench`: which prompt file each one reads and whether its requests are
constrained by the prompt's JSON schema.

    run_scenarios(("json", "code"), is_schema=True)   # -> ("json", "json_noschema", "code")
    prompt_file("json_noschema")                      # -> "json"

The json prompts run twice on the stack by default, so the effect of the constraint is measured in
one run on the same prompts: "json" sends each row's schema as response_format (grammar masks, and
the grammar-forced draft decoder), "json_noschema" sends the same requests without it. --no-schema
keeps only "json_noschema". Every output of a row with a schema is checked against it either way.

"long" is the reference article's setting, batch 1 at a sequence length of about 2,048: it reads no file
of its own but the rows of LONG_SOURCES (those present in the data folder: Spec-Bench's summarization
and RAG rows, long Arena-Hard prompts) whose prompt tokens, chat template included, fall in
[LONG_MIN_PROMPT_TOKENS, LONG_MAX_PROMPT_TOKENS] (bench.suite.select_long), and asks for
LONG_MAX_NEW_TOKENS new tokens unless --max-new-tokens says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.prompts import BenchPrompt

PROMPT_FILES = ("json", "code", "prose", "specbench")  # data/prompts/{name}.jsonl
CONSTRAINED = "json"  # the scenario sent with response_format
UNCONSTRAINED_SUFFIX = "_noschema"
UNCONSTRAINED = CONSTRAINED + UNCONSTRAINED_SUFFIX  # the same prompts, no response_format
LONG = "long"
SCENARIOS = (*PROMPT_FILES, LONG)  # what --scenarios accepts
LONG_SOURCES = ("specbench", "prose", "code")  # natural-language rows; json's long rows are schemas
LONG_MIN_PROMPT_TOKENS = 1500
LONG_MAX_PROMPT_TOKENS = 1900  # + LONG_MAX_NEW_TOKENS: the context the stack is started with
LONG_MAX_NEW_TOKENS = 256


def run_scenarios(prompt_files: Sequence[str], is_schema: bool) -> tuple[str, ...]:
    """The scenarios measured for the named prompt files, in order; json expands to both variants."""
    out: list[str] = []
    for name in prompt_files:
        if name == CONSTRAINED:
            out.extend((CONSTRAINED, UNCONSTRAINED) if is_schema else (UNCONSTRAINED,))
        else:
            out.append(name)
    return tuple(out)


def prompt_file(scenario: str) -> str:
    """The prompt file a scenario reads: "json_noschema" -> "json", "code" -> "code"."""
    return scenario.removesuffix(UNCONSTRAINED_SUFFIX)


def is_constrained(scenario: str, prompt: BenchPrompt) -> bool:
    """Whether this scenario's request for this prompt carries the prompt's schema as response_format."""
    return scenario == CONSTRAINED and prompt.schema is not None
