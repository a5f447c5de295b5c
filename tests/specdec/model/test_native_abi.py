"""The ctypes declarations of the native kernels (`native.FUNCTIONS`) against csrc/qgemm.h's prototypes.

ctypes trusts its declarations: an argument missing, added or of another width would pass the wrong
bits without a word, so every exported function's prototype is read from the header and compared,
argument by argument, with the table. No compiler is needed.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from specdec.model import native

# C scalar types -> their ctypes; a pointer is the untyped _P or a pointer to its pointee's ctype
_SCALARS: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int32,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_STRUCTS = {"qweight": native.QWeight, "qlayer": native.QLayer, "qspan": native.QSpan}
_PROTOTYPE = re.compile(r"^([A-Za-z_][\w ]*?\s*\*?)\s*(qgemm_\w+)\(([^)]*)\);", re.MULTILINE | re.DOTALL)


def header_prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (result type, argument declarations) for every `qgemm_*` function declared in `text`."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    prototypes = {}
    for result, name, arguments in _PROTOTYPE.findall(text):
        declarations = [" ".join(a.split()) for a in arguments.split(",")]
        prototypes[name] = (" ".join(result.split()), [] if declarations == ["void"] else declarations)
    return prototypes


def agrees(c_type: str, ctype: type | None) -> bool:
    """Whether a C type (`const qweight *`, `int64_t`, an argument with its name) is passed as `ctype`."""
    words = c_type.replace("*", " * ").replace("const", " ").split()
    is_pointer = "*" in words
    base = next(w for w in words if w != "*")
    if base == "char" and is_pointer:
        return ctype is ctypes.c_char_p
    if not is_pointer:
        return _SCALARS[base] is ctype
    pointee = _STRUCTS.get(base) or _SCALARS.get(base)
    return ctype is ctypes.c_void_p or (pointee is not None and ctype is ctypes.POINTER(pointee))


def mismatches(prototypes: dict[str, tuple[str, list[str]]], table) -> list[str]:
    """Where `table` (name -> (result type, argument types)) differs from the header's prototypes."""
    found = [f"{name} is in the header, not in the table" for name in prototypes if name not in table]
    found += [f"{name} is in the table, not in the header" for name in table if name not in prototypes]
    for name in (n for n in prototypes if n in table):
        (c_result, c_arguments), (result, arguments) = prototypes[name], table[name]
        if not agrees(c_result, result):
            found.append(f"{name} returns {c_result}, declared {result}")
        if len(c_arguments) != len(arguments):
            found.append(f"{name} takes {len(c_arguments)} arguments, declared {len(arguments)}")
            continue
        found += [
            f"{name} argument {i} is {c}, declared {p}"
            for i, (c, p) in enumerate(zip(c_arguments, arguments))
            if not agrees(c, p)
        ]
    return found


def test_every_header_function_is_declared_with_its_prototypes_types():
    prototypes = header_prototypes((native.SOURCE_DIR / "qgemm.h").read_text())
    assert len(prototypes) == len(native.FUNCTIONS) == 24
    assert mismatches(prototypes, native.FUNCTIONS) == []


def test_a_prototype_is_read_across_lines_and_named_argument_by_argument():
    text = """/* a comment: int qgemm_fake(int); */
int qgemm_linear(const float *x, int64_t T, const qweight *w,
                 float *out, int num_threads);
const char *qgemm_isa(void);
"""
    assert header_prototypes(text) == {
        "qgemm_linear": ("int", ["const float *x", "int64_t T", "const qweight *w", "float *out", "int num_threads"]),
        "qgemm_isa": ("const char *", []),
    }


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda t: t.pop("qgemm_isa"), "qgemm_isa is in the header, not in the table"),
        (lambda t: t["qgemm_linear"][1].pop(), "qgemm_linear takes 5 arguments, declared 4"),
        (lambda t: t["qgemm_linear"][1].__setitem__(1, ctypes.c_int32), "qgemm_linear argument 1 is int64_t T"),
        (lambda t: t["qgemm_linear"][1].__setitem__(2, ctypes.POINTER(native.QSpan)), "argument 2 is const qweight"),
        (lambda t: t.__setitem__("qgemm_rmsnorm", (ctypes.c_int32, t["qgemm_rmsnorm"][1])), "qgemm_rmsnorm returns"),
    ],
)
def test_a_declaration_that_differs_from_the_header_is_named(change, what):
    table = {name: (result, list(arguments)) for name, (result, arguments) in native.FUNCTIONS.items()}
    change(table)
    found = mismatches(header_prototypes((native.SOURCE_DIR / "qgemm.h").read_text()), table)
    assert len(found) == 1 and what in found[0], found
