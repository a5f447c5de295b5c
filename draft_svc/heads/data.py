"""Training prompts for the feature drafter: built from text that ships with Python, never from a
benchmark set.

The drafter learns what the primary itself writes (self-distillation: draft_svc/heads/generate.py),
so a prompt only has to ask for the kinds of answers users ask for (code, JSON under a schema,
prose); its answer is the primary's. Sources (every one is read from the running interpreter's own
files; nothing is downloaded):

    stdlib-code   Public functions and methods of the standard library (its .py files read with `ast`,
                  not imported; tests, demos and GUI toolkits skipped): a chat request to write the
                  function from its signature and docstring summary, or the signature and docstring
                  fed raw for completion. PSF License 2.0.
    stdlib-json   The same functions as tool calls: a request in words, answered under a JSON Schema
                  built from the function's parameters (response_format, grammar-constrained as the
                  service would). PSF License 2.0.
    python-docs   The Language Reference topics that `help()` shows (`pydoc_data/topics.py`):
                  explain or summarise a passage. PSF License 2.0.
    writing       Writing requests composed here from FORMS x SUBJECTS x TONES, a third of them asking
                  for the answer in one of LANGUAGES (this project's own lists, under its licence).

None of BFCL, JSONSchemaBench, HumanEval, MBPP, Arena-Hard, EQ-Bench, MT-bench, Spec-Bench or
bench/data/ is read.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import random
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from draft_svc.heads import composed

SOURCES: dict[str, str] = {
    "stdlib-code": "Python standard library function signatures and docstrings (PSF License 2.0)",
    "stdlib-json": "Python standard library function parameters as JSON Schemas (PSF License 2.0)",
    "python-docs": "Python Language Reference topics, pydoc_data/topics.py (PSF License 2.0)",
    "writing": "writing requests composed from this project's own lists (the project's licence)",
    "programming": "programming tasks in twenty languages, this project's own lists (the project's licence)",
    "concepts": "requests to explain concepts, this project's own lists (the project's licence)",
    "everyday": "emails, plans and advice, this project's own lists (the project's licence)",
    "multilingual": "requests written in twelve other languages for this project (the project's licence)",
    "tool-calls": "tool-call requests and argument schemas written for this project (the project's licence)",
}
# The default mix: Python's own text a third, the composed requests the rest.
DEFAULT_SHARES = {
    "stdlib-code": 0.12, "stdlib-json": 0.08, "python-docs": 0.06, "writing": 0.12, "programming": 0.2,
    "concepts": 0.12, "everyday": 0.08, "multilingual": 0.1, "tool-calls": 0.12,
}  # fmt: skip

# Standard-library folders whose files are tests, demos or GUI toolkits, not code users write.
SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "turtledemo", "ensurepip", "tkinter", "lib2to3", "site-packages"}
)
MAX_FILE_BYTES = 1 << 20

FORMS = (
    "a short story", "a poem", "a letter to a friend", "a dialogue between two characters",
    "a product description", "a short speech", "a diary entry", "a short essay", "a news report",
    "a list of practical tips", "a fable with a moral", "a limerick", "a travel guide paragraph",
    "a job advertisement", "a review", "a scene for a play", "a motivational message",
    "an explanation for a ten-year-old", "a persuasive paragraph", "a haiku sequence",
)  # fmt: skip
SUBJECTS = (
    "a lighthouse keeper who finds a message in a bottle", "the first day of spring in a small town",
    "a robot learning to bake bread", "a lost cat finding its way home", "the history of the bicycle",
    "why sleep matters", "a city without cars", "a chess game between old rivals", "the ocean at night",
    "a detective who is afraid of the dark", "learning a new language as an adult", "a mountain village market",
    "a friendship between a crow and a fox", "the smell of rain", "a library that never closes",
    "an astronaut's last day on the station", "growing tomatoes on a balcony", "a storm at sea",
    "the invention of the printing press", "a grandmother's recipe book", "a train journey across a desert",
    "a musician who lost her hearing", "the benefits of walking every day", "a village festival",
    "a time traveller stuck in the wrong century", "saving money on a small income", "a haunted bookshop",
    "the life of a honeybee", "a shy student giving a speech", "an old clock that stops at midnight",
    "moving to a new country", "a painter who only paints the sky", "the importance of clean water",
    "a dragon who wants to be a chef", "a winter night in the forest", "the joy of reading aloud",
    "a football match in the rain", "a inventor's failed experiments", "a quiet morning cafe",
    "teamwork on a sailing boat", "the moon landing", "a garden that grows overnight",
    "a postman in the mountains", "kindness between strangers", "a forgotten toy in an attic",
    "the changing seasons", "a bridge between two rival towns", "a child's first snowfall",
    "the life of a lighthouse", "a night market in a busy city",
)  # fmt: skip
CODE_TEMPLATES = (
    "Write a Python function `{signature}` that does the following: {summary}",
    "Implement `{signature}` in Python. {summary} Include a short docstring.",
    "Can you write Python code for `{signature}`? It should work like this: {summary}",
)
JSON_TEMPLATES = (
    "I want to call `{qualname}`: {summary} Give me the arguments.",
    "Prepare the parameters for {qualname}. {summary}",
    "Fill in a call to `{qualname}` for a typical use. {summary}",
)
DOCS_TEMPLATES = (
    "Explain this part of the Python documentation in simple words, with an example:\n\n{text}",
    "Summarize the following text in a few sentences:\n\n{text}",
    "What does this mean for a Python programmer?\n\n{text}",
)
# Answers in other languages: users write in them (the prompts ask in English; the answer is the model's)
LANGUAGES = (
    "Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Polish", "Czech", "Russian",
    "Ukrainian", "Turkish", "Vietnamese", "Indonesian", "Chinese", "Japanese", "Korean", "Arabic", "Hindi",
)  # fmt: skip
LANGUAGE_SHARE = 0.3  # of writing prompts
TONES = ("", " Keep it light and funny.", " Make it moving.", " Use simple words.", " Make it formal.")
WRITING_TEMPLATE = "Write {form} about {subject}.{tone}"
MAX_PROMPT_CHARS = 1500


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingPrompt:
    source: str  # a key of SOURCES
    text: str  # the user message, or the raw text of a completion prompt
    is_completion: bool = False  # fed raw, without the chat template
    schema: str | None = None  # JSON Schema text: the answer is generated under it


@dataclasses.dataclass(frozen=True, slots=True)
class _Function:
    module: str
    name: str
    signature: str  # "name(a, b=1)"
    doc: str
    params: tuple[tuple[str, str, bool], ...]  # (name, JSON type, required)


def training_prompts(
    seed: int, shares: dict[str, float] | None = None, num_prompts: int = 4000
) -> list[TrainingPrompt]:
    """`num_prompts` prompts drawn from every source in `shares` (default: DEFAULT_SHARES), shuffled
    with `seed`: the same list for the same arguments on the same Python."""
    shares = shares or DEFAULT_SHARES
    rng = random.Random(seed)
    functions = _functions()
    pools = {
        "stdlib-code": _code_prompts(functions, rng),
        "stdlib-json": _json_prompts(functions, rng),
        "python-docs": _docs_prompts(rng),
        "writing": _writing_prompts(rng),
        "programming": [TrainingPrompt("programming", t) for t in composed.programming_requests(rng)],
        "concepts": [TrainingPrompt("concepts", t) for t in composed.concept_requests(rng)],
        "everyday": [TrainingPrompt("everyday", t) for t in composed.everyday_requests(rng)],
        "multilingual": [TrainingPrompt("multilingual", t) for t in composed.multilingual_requests()],
        "tool-calls": [TrainingPrompt("tool-calls", t, schema=s) for t, s in composed.tool_requests(rng)],
    }
    if unknown := sorted(set(shares) - set(pools)):
        raise ValueError(f"unknown training prompt sources {unknown}; known: {sorted(pools)}")
    out: list[TrainingPrompt] = []
    for source, share in shares.items():
        pool = pools[source]
        rng.shuffle(pool)
        want = round(share * num_prompts)
        out.extend(pool[i % len(pool)] for i in range(want))  # a small pool repeats (its answers are sampled)
    rng.shuffle(out)
    return out


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def _functions() -> tuple[_Function, ...]:
    """Public functions and methods with a docstring of every standard-library module (read, not imported;
    once a process)."""
    out: list[_Function] = []
    root = _stdlib()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.intersection(relative.parts) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        for node in _public_functions(tree):
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            params = _params(node.args)
            args = node.args
            if args.args and args.args[0].arg in ("self", "cls"):
                args = ast.arguments(
                    posonlyargs=args.posonlyargs,
                    args=args.args[1:],
                    vararg=args.vararg,
                    kwonlyargs=args.kwonlyargs,
                    kw_defaults=args.kw_defaults,
                    kwarg=args.kwarg,
                    defaults=args.defaults[-len(args.args) + 1 :] if len(args.args) > 1 else [],
                )
            out.append(_Function(module, node.name, f"{node.name}({ast.unparse(args)})", doc, params))
    return tuple(out)


def _public_functions(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from (n for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))


def _params(args: ast.arguments) -> tuple[tuple[str, str, bool], ...]:
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults, strict=True)) + list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    out = []
    for arg, default in pairs:
        if arg.arg in ("self", "cls"):
            continue
        out.append((arg.arg, _json_type(arg.annotation, default), default is None))
    return tuple(out)


def _json_type(annotation: ast.expr | None, default: ast.expr | None) -> str:
    hint = ast.unparse(annotation) if annotation is not None else ""
    value = default.value if isinstance(default, ast.Constant) else None
    if hint == "bool" or isinstance(value, bool):
        return "boolean"
    if hint == "int" or isinstance(value, int):
        return "integer"
    if hint == "float" or isinstance(value, float):
        return "number"
    return "string"


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return first if first.endswith(".") else first + "."


def _code_prompts(functions: Sequence[_Function], rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for f in functions:
        if rng.random() < 0.3:  # completion style: the signature and docstring, fed raw
            doc = f.doc.strip().replace('"""', "'''")
            text = f'def {f.signature}:\n    """{doc}\n    """\n'
            out.append(TrainingPrompt("stdlib-code", text[:MAX_PROMPT_CHARS], is_completion=True))
        else:
            template = rng.choice(CODE_TEMPLATES)
            out.append(TrainingPrompt("stdlib-code", template.format(signature=f.signature, summary=_summary(f.doc))))
    return out


def _json_prompts(functions: Sequence[_Function], rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for f in functions:
        if not f.params:
            continue
        schema = {
            "type": "object",
            "properties": {name: {"type": kind} for name, kind, _ in f.params},
            "required": [name for name, _, required in f.params if required],
        }
        text = rng.choice(JSON_TEMPLATES).format(qualname=f"{f.module}.{f.name}", summary=_summary(f.doc))
        out.append(TrainingPrompt("stdlib-json", text[:MAX_PROMPT_CHARS], schema=json.dumps(schema)))
    return out


def _docs_prompts(rng: random.Random) -> list[TrainingPrompt]:
    path = _stdlib() / "pydoc_data" / "topics.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    topics = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["topics"]
    )
    out = []
    for name in sorted(topics):
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 200]
        for paragraph in paragraphs:
            template = rng.choice(DOCS_TEMPLATES)
            out.append(TrainingPrompt("python-docs", template.format(text=paragraph[: MAX_PROMPT_CHARS - 100])))
    return out


def _writing_prompts(rng: random.Random) -> list[TrainingPrompt]:
    out = []
    for form in FORMS:
        for subject in SUBJECTS:
            for tone in TONES:
                text = WRITING_TEMPLATE.format(form=form, subject=subject, tone=tone)
                if rng.random() < LANGUAGE_SHARE:
                    text += f" Write it in {rng.choice(LANGUAGES)}."
                out.append(TrainingPrompt("writing", text))
    return out
