"""A signature quoted in the docs is the function's signature (``inspect.signature``).

The convention (docs/contributing.md, "Docs that stay true"): in a code span, a
heading or a code block, ``name(args)`` for a public hvdkit name is a
*signature quote* when it is written as one: it contains a bare ``*``, a
``*args`` or ``**kwargs``, or stands in a heading, or every argument is a
parameter name, starting with the first, with at least one default written
and each equal to the code's.
A signature quote lists every parameter, in order, keyword-only ones after
``*``, with the code's defaults; ``...`` in it means "and more" and the names
given must then appear in that order. Anything else (``allreduce(x, op=Sum)``)
is a call, shown as an example, and not compared.
"""

from __future__ import annotations

import ast
import inspect
import re

import pytest
from _docs import PAGES, code, page_module, resolve, text

_NAME_CALL = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\(")
_FORWARDS = re.compile(r"Takes the arguments of :(?:func|class):`~?([\w.]+)`")


def calls(snippet: str) -> list[tuple[str, str]]:
    """(name, argument text) of every ``name(...)`` in a snippet, parentheses balanced."""
    out = []
    for match in _NAME_CALL.finditer(snippet):
        depth, i = 1, match.end()
        while i < len(snippet) and depth:
            depth += {"(": 1, ")": -1}.get(snippet[i], 0)
            i += 1
        if depth == 0:
            out.append((match.group(1), snippet[match.end() : i - 1]))
    return out


def split_args(args: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


_ARG = re.compile(r"(\*{0,2})([A-Za-z_]\w*)?(?:\s*:\s*[^=]+?)?(?:\s*=\s*(.+))?$")


def quoted_parameters(args: str) -> list[tuple[str, str, str | None]] | None:
    """[(name or marker, kind, default text)] when every argument reads as a parameter."""
    out: list[tuple[str, str, str | None]] = []
    keyword_only = False
    for arg in split_args(args):
        if arg in ("...", "…"):
            out.append(("...", "more", None))
            continue
        match = _ARG.match(arg)
        if not match or (match.group(1) and match.group(3)):
            return None
        stars, name, default = match.groups()
        if stars == "*":
            keyword_only = True
            if name:
                out.append((name, "VAR_POSITIONAL", None))
            continue
        if not name:
            return None
        if stars == "**":
            out.append((name, "VAR_KEYWORD", None))
            continue
        out.append((name, "KEYWORD_ONLY" if keyword_only else "POSITIONAL", default))
    return out


def real_signature(obj: object) -> inspect.Signature | None:
    """The signature a quote is compared with; a forwarder's (``init``) is its target's."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    forwards = _FORWARDS.search(inspect.getdoc(obj) or "")
    kinds = {p.kind for p in signature.parameters.values()}
    if forwards and inspect.Parameter.VAR_KEYWORD in kinds:
        module_name, _, name = forwards.group(1).rpartition(".")
        target = getattr(__import__(module_name, fromlist=[name]), name)
        return inspect.signature(target)
    return signature


def same_default(written: str, actual: object) -> bool:
    if actual is inspect.Parameter.empty:
        return False
    try:
        return ast.literal_eval(written) == actual
    except (ValueError, SyntaxError):
        label = getattr(actual, "__name__", None) or getattr(actual, "name", None) or str(actual)
        return written.split(".")[-1] == str(label).split(".")[-1]


def kind_of(parameter: inspect.Parameter) -> str:
    if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
        return "POSITIONAL"
    return parameter.kind.name


def is_signature_quote(quoted, real: inspect.Signature, heading: bool) -> bool:
    real_names = list(real.parameters)
    if not quoted:
        return False  # `shutdown()`, `shard()`: the name, not its signature
    if heading or any(kind.startswith("VAR") or kind == "KEYWORD_ONLY" for _, kind, _ in quoted):
        return True
    named = [(n, d) for n, kind, d in quoted if kind != "more"]
    if not named or not set(n for n, _ in named) <= set(real_names):
        return False
    if named[0][0] != real_names[0]:
        return False  # a call: `init(pin_gpu=True)` starts after the first parameter
    written = [(n, d) for n, d in named if d is not None]
    return bool(written) and all(same_default(d, real.parameters[n].default) for n, d in written)


def differences(quoted, real: inspect.Signature) -> list[str]:
    params = [p for p in real.parameters.values() if p.name not in ("self", "cls")]
    problems = []
    by_name = {p.name: p for p in params}
    for name, kind, default in quoted:
        if kind == "more":
            continue
        if name not in by_name:
            problems.append(f"no parameter {name!r}")
            continue
        p = by_name[name]
        if kind != kind_of(p):
            problems.append(f"{name} is {kind_of(p).lower()}, not {kind.lower()}")
        if default is None and p.default is not p.empty and kind.startswith(("POS", "KEY")):
            problems.append(f"{name} has a default ({p.default!r}) the quote leaves out")
        if default is not None and not same_default(default, p.default):
            problems.append(f"{name}={default} but the code's default is {p.default!r}")
    order = [n for n, kind, _ in quoted if kind != "more" and n in by_name]
    if order != [p.name for p in params if p.name in order]:
        problems.append(f"order {order} differs from the code's")
    if not any(kind == "more" for _, kind, _ in quoted):
        left_out = [p.name for p in params if p.name not in {n for n, _, _ in quoted}]
        if left_out:
            problems.append(f"leaves out {left_out}")
    return problems


def signature_quotes():
    """(page, line, quote, dotted name, problems) for every signature quote in the docs."""
    for page in PAGES:
        module = page_module(page)
        lines = text(page).splitlines()
        for number, snippet in code(page):
            heading = lines[number - 1].startswith("#")
            for name, args in calls(snippet):
                found = resolve(name, module)
                quoted = quoted_parameters(args)
                if found is None or quoted is None:
                    continue
                dotted, obj = found
                real = real_signature(obj)
                if real is None or not is_signature_quote(quoted, real, heading):
                    continue
                if {p.kind for p in real.parameters.values()} >= {
                    inspect.Parameter.VAR_POSITIONAL,
                    inspect.Parameter.VAR_KEYWORD,
                }:
                    continue  # (*args, **kwargs): the code has no signature to compare with
                yield page, number, f"{name}({args})", dotted, differences(quoted, real)


def test_every_quoted_signature_is_the_code_s():
    wrong = [
        f"{page}:{line}: `{quote}` ({dotted}{real_signature(resolve(dotted)[1])}): "
        + "; ".join(problems)
        for page, line, quote, dotted, problems in signature_quotes()
        if problems
    ]
    assert not wrong, "signatures in the docs that the code does not have:\n" + "\n".join(wrong)


def test_the_docs_quote_signatures_at_all():
    """Guards the check itself: it finds the signature quotes the pages are built on."""
    found = {dotted for _, _, _, dotted, _ in signature_quotes()}
    assert {"hvdkit.sink.data_sink", "hvdkit.sink.train"} <= found, found


@pytest.mark.parametrize(
    ("quote", "is_signature", "problems"),
    [
        ("f(a, b=1, *, c=None)", True, []),
        ("f(a, b=2)", False, None),  # a call: b given another value
        ("f(x, b=1)", False, None),  # a call: x is not a parameter
        ("f(b=1)", False, None),  # a call: it does not start at the first parameter
        ("f(a, b=1)", True, ["leaves out ['c']"]),
        ("f(a, *, c=None)", True, ["leaves out ['b']"]),
        ("f(a, ..., c=None)", True, ["c is keyword_only, not positional"]),
        ("f(a, b=1, *, c=None, d=0)", True, ["no parameter 'd'"]),
        ("f(a, b=3, *, c=None)", True, ["b=3 but the code's default is 1"]),
    ],
)
def test_the_convention_on_a_known_function(quote, is_signature, problems):
    def f(a, b=1, *, c=None):
        pass

    name, args = calls(quote)[0]
    quoted = quoted_parameters(args)
    real = inspect.signature(f)
    assert is_signature_quote(quoted, real, heading=False) is is_signature
    if is_signature:
        assert differences(quoted, real) == problems
