"""The public API is what docs/api.md lists (issue 28), and the code and the documents say the same.

- docs/api.md's names are exactly the union of the public modules' ``__all__`` (read from the
  source, so no framework needs to be installed), and its public modules are PUBLIC_MODULES;
- every public name imports and has a docstring of its own; every error's bases and fields are
  the ones api.md gives; api.md's commands are the CLI's;
- every ``txckpt.`` name the user documents use (README.md and docs/*.md: ```python blocks,
  ``from txckpt... import`` lines, and inline code outside api.md and architecture.md, which
  name internal modules on purpose) resolves and is public;
- ``import txckpt`` imports none of the frameworks the integrations adapt.

In-process and fast: no child process, no server, no Trainer."""

from __future__ import annotations

import argparse
import ast
import glob
import importlib
import importlib.abc
import inspect
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(HERE, "docs", "api.md")

#: The public modules; every other txckpt module is internal (docs/api.md, "Public modules").
PUBLIC_MODULES = (
    "txckpt",
    "txckpt.errors",
    "txckpt.preemption",
    "txckpt.integrations.transformers",
    "txckpt.integrations.accelerate",
    "txckpt.integrations.dcp",
    "txckpt.integrations.lightning",
)
#: What a public module needs that a core install may lack.
NEEDS = {
    "txckpt.integrations.transformers": "transformers",
    "txckpt.integrations.accelerate": "accelerate",
    "txckpt.integrations.lightning": "lightning",
}
FRAMEWORKS = ("transformers", "accelerate", "deepspeed", "lightning")
#: User documents whose inline code is checked too (api.md and architecture.md name internal
#: modules on purpose; docs/dev/ is for maintainers).
USER_DOCS = sorted([os.path.join(HERE, "README.md")] + glob.glob(os.path.join(HERE, "docs", "*.md")))
INLINE_EXEMPT = {"api.md", "architecture.md"}

DOTTED = re.compile(r"(?<![\w./-])txckpt(?:\.[A-Za-z_]\w*)+")
#: Markdown inline code: a run of backticks, then anything up to a run of as many (``x`` too).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


# ----- reading docs/api.md and the __all__ lists --------------------------------------------------


def _sections(path: str = API_MD) -> dict[str, str]:
    """``## heading`` -> the text under it."""
    text = open(path).read()
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _bullets(section: str, package: bool = False) -> list[tuple[str, str]]:
    """(dotted name, the rest of the line) of each ``- `txckpt.X...`...`` bullet (also of
    ``- `txckpt`...`` with ``package``; never of a command, ``- `txckpt log ROOT```)."""
    name = r"txckpt(?:\.\w+)*(?=`)" if package else r"txckpt(?:\.\w+)+"
    return [(m.group(1), m.group(2)) for m in re.finditer(rf"^- `({name})[^`]*`(.*)$", section, re.M)]


def api_modules() -> list[str]:
    return [name for name, _ in _bullets(_sections()["Public modules"], package=True)]


def api_names() -> list[str]:
    """Every name docs/api.md lists, in its order (duplicates kept, for the test to see)."""
    return [name for title, text in _sections().items() if title != "Public modules" for name, _ in _bullets(text)]


def _source(module: str) -> str:
    base = os.path.join(HERE, *module.split("."))
    return base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")


def static_all(module: str) -> list[str]:
    """``module.__all__`` as its source writes it (a literal list), without importing it."""
    tree = ast.parse(open(_source(module)).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no literal __all__")


def public_names() -> list[str]:
    return [f"{m}.{n}" for m in PUBLIC_MODULES for n in static_all(m)]


def _import(module: str):
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    return importlib.import_module(module)


def _split(name: str) -> tuple[str, str]:
    """A public name's (module, attribute): the longest public module it starts with."""
    module = max((m for m in PUBLIC_MODULES if name.startswith(m + ".")), key=len)
    return module, name[len(module) + 1 :]


# ----- (a) docs/api.md == the public __all__s ------------------------------------------------------


def test_api_md_names_the_public_modules():
    assert api_modules() == list(PUBLIC_MODULES)


def test_api_md_lists_exactly_the_public_all():
    listed = api_names()
    assert len(listed) > 50, "docs/api.md's lists were not read (format changed?)"
    assert sorted(n for n in set(listed) if listed.count(n) > 1) == [], "listed twice in docs/api.md"
    exported = public_names()
    assert sorted(n for n in set(exported) if exported.count(n) > 1) == [], "twice in one __all__"
    assert sorted(set(exported) - set(listed)) == [], "in a public __all__ but not in docs/api.md"
    assert sorted(set(listed) - set(exported)) == [], "in docs/api.md but in no public __all__"


def test_the_static_all_is_the_all():
    for module in ("txckpt", "txckpt.errors", "txckpt.preemption", "txckpt.integrations.dcp"):
        assert list(importlib.import_module(module).__all__) == static_all(module)


# ----- (b) every public name imports and is documented --------------------------------------------


def _own_doc(obj) -> str:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    doc = (doc or "").strip()
    if isinstance(obj, type) and doc.startswith(f"{obj.__name__}("):
        return ""  # the signature a dataclass writes for itself: no documentation
    return doc


@pytest.mark.parametrize("name", public_names())
def test_public_name_imports_and_is_documented(name):
    module, attr = _split(name)
    obj = getattr(_import(module), attr)  # AttributeError: in __all__, not defined
    if inspect.isclass(obj) or inspect.isroutine(obj):
        assert _own_doc(obj), f"{name} has no docstring of its own"
    descriptions = {n: rest for title, text in _sections().items() for n, rest in _bullets(text)}
    assert len(descriptions.get(name, "").strip(" :")) >= 10, f"docs/api.md says nothing of {name}"


def test_errors_have_the_bases_and_fields_api_md_gives():
    import txckpt.errors as errors

    lines = _bullets(_sections()["Errors"])
    assert len(lines) == len(errors.__all__) + 1  # and txckpt.TxckptError
    for name, rest in lines:
        if not name.startswith("txckpt.errors."):
            continue
        cls = getattr(errors, name.rsplit(".", 1)[1])
        m = re.match(r"\s*\(bases: ([^;)]*)(?:; fields: ([^)]*))?\)", rest)
        assert m, f"docs/api.md: {name} needs '(bases: ...; fields: ...)'"
        bases = [b.strip(" `") for b in m.group(1).split(",")]
        fields = [f.strip(" `") for f in m.group(2).split(",")] if m.group(2) else []
        assert bases == [b.__name__ for b in cls.__bases__], name
        assert fields == list(cls.fields), name
    assert {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.TxckptError)} == {
        getattr(errors, n) for n in errors.__all__
    }, "an error class missing from txckpt.errors.__all__"


def test_api_md_commands_are_the_clis():
    from txckpt.cli import build_parser

    listed = re.findall(r"^- `txckpt (\w+)", _sections()["Command line"], re.M)
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert listed == list(sub.choices)


# ----- (c) what the documents tell users to use is public -----------------------------------------


def _is_public(dotted: str) -> str | None:
    """None if ``dotted`` (a module, a name, or an attribute of one) is public, else why not."""
    if dotted in PUBLIC_MODULES or any(m.startswith(dotted + ".") for m in PUBLIC_MODULES):
        return None  # a public module, or a package on the way to one (txckpt.integrations)
    module = max((m for m in PUBLIC_MODULES if dotted.startswith(m + ".")), key=len)
    first, *rest = dotted[len(module) + 1 :].split(".")
    if first not in static_all(module):
        return f"{module}.{first} is not public (not in {module}.__all__)"
    if rest:
        if module in NEEDS:
            try:
                importlib.import_module(NEEDS[module])
            except ImportError:
                return None  # cannot look further without the framework
        obj = getattr(importlib.import_module(module), first)
        for i, part in enumerate(rest):
            if not hasattr(obj, part):
                return f"{'.'.join([module, first, *rest[: i + 1]])} does not exist"
            obj = getattr(obj, part)
    return None


def _imports_in(code: str) -> list[str]:
    """The dotted names ``from txckpt... import a, b`` / ``import txckpt...`` lines name."""
    out = []
    try:
        tree = ast.parse(code)
    except SyntaxError:  # prose, or a fragment: the lines one by one
        for m in re.finditer(r"^\s*from\s+(txckpt[\w.]*)\s+import\s+\(?([\w\s,]+)", code, re.M):
            out += [f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",") if n.strip()]
        out += re.findall(r"^\s*import\s+(txckpt[\w.]*)", code, re.M)
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "txckpt":
            out += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "txckpt"]
    return out


def doc_references(path: str) -> list[str]:
    text = open(path).read()
    refs = []
    fence = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
    for m in fence.finditer(text):
        if m.group(1).split()[:1] == ["python"]:
            refs += DOTTED.findall(m.group(2)) + _imports_in(m.group(2))
    prose = fence.sub("", text)
    refs += _imports_in(prose)
    if os.path.basename(path) not in INLINE_EXEMPT:
        for _, span in CODE_SPAN.findall(prose):
            if "python -m " not in span:  # a command line: python -m txckpt.demo ROOT
                refs += DOTTED.findall(span)
    return refs


def test_documents_use_txckpt_names():
    refs = {os.path.relpath(p, HERE): doc_references(p) for p in USER_DOCS}
    assert len(refs) >= 10 and sum(map(len, refs.values())) > 150, "the documents' names were not read"
    assert len(refs["README.md"]) > 20


@pytest.mark.parametrize("doc", [os.path.relpath(p, HERE) for p in USER_DOCS])
def test_documents_name_only_public_api(doc):
    wrong = sorted(
        {f"{ref}: {why}" for ref in doc_references(os.path.join(HERE, doc)) if (why := _is_public(ref)) is not None}
    )
    assert wrong == [], f"{doc} tells users to use what docs/api.md does not make public"


# ----- (d) import txckpt imports no framework ----------------------------------------------------


class _FrameworkBlocker(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FRAMEWORKS:
            self.attempts.append(name)
            raise ImportError(f"test_public_api: `import txckpt` must not import {name}")
        return None


def _ours_or_framework(name: str) -> bool:
    return name.split(".")[0] in ("txckpt", *FRAMEWORKS)


def test_import_txckpt_imports_no_framework(monkeypatch):
    """A fresh ``import txckpt`` in this process, with every txckpt and framework module set
    aside (and put back after: other tests keep their objects) and the frameworks blocked."""
    # No stub for ctypes.util.find_library: txckpt._base.fileio used to call it at import, which runs
    # `ldconfig -p` in a child process; the fast tier's guard fails this test if it comes back.
    saved = {n: m for n, m in sys.modules.items() if _ours_or_framework(n)}
    for n in saved:
        del sys.modules[n]
    blocker = _FrameworkBlocker()
    sys.meta_path.insert(0, blocker)
    try:
        try:
            fresh = importlib.import_module("txckpt")
        except ImportError:
            if not blocker.attempts:
                raise
        else:
            assert fresh is not saved.get("txckpt")
        loaded = sorted(n for n in sys.modules if n.split(".")[0] in FRAMEWORKS)
    finally:
        sys.meta_path.remove(blocker)
        for n in [n for n in sys.modules if _ours_or_framework(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
    assert (blocker.attempts, loaded) == ([], []), "import txckpt imports a framework"
