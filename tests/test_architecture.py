"""docs/architecture.md stays true (issue 15): every txckpt module is on exactly one floor of its
``floors`` block, every import (module level, inside functions, under TYPE_CHECKING) goes to a
lower floor or, within one package, to the same floor; there is no import cycle; every module
names the one concept it owns in its docstring's first line, whatever its length (issue 46: the
600-line cap decided where code went, not the concept); the core does not import the frameworks
the integrations adapt; imports are at the top of their modules (at most 30 inside functions in
txckpt/, issue 28), and ``import txckpt`` leaves torch and the optional backends to first use
(txckpt/_base/deps.py)."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(HERE, "txckpt")
#: Imports inside functions (any depth) allowed in txckpt/ in all: a module's neighbours are in its
#: header. What waits for first use (torch, the optional backends) goes through txckpt/_base/deps.py,
#: one loader (one import) per module, not one import per call site (issue 28).
MAX_FUNCTION_IMPORTS = 30
#: What ``import txckpt`` (and the CLI's ``import txckpt.cli``) must not import: txckpt/_base/deps.py
#: imports these on first use (torch brings torch.distributed), and the frameworks are the
#: integrations' (docs/architecture.md).
DEFERRED = ("torch", "safetensors", "fsspec", "s3fs", "boto3", "botocore", "aiobotocore", "gcsfs", "adlfs", "tqdm")
FRAMEWORKS = ("transformers", "accelerate", "deepspeed", "lightning")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, HERE)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _from_module(node: ast.ImportFrom, name: str, path: str) -> str:
    """The absolute module a ``from ... import`` in module ``name`` (at ``path``) reads from."""
    if not node.level:
        return node.module or ""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: str, modules: dict[str, str]) -> tuple[set[str], set[str]]:
    """(txckpt modules ``name`` imports, top-level names of other packages it imports)."""
    tree = ast.parse(open(path).read(), path)
    inner, outer = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, name, path)
            if mod == "txckpt" or mod.startswith("txckpt."):
                for alias in node.names:  # `from . import log` names a module
                    sub = f"{mod}.{alias.name}"
                    inner.add(sub if sub in modules else mod)
            else:
                outer.add(mod.split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "txckpt" or alias.name.startswith("txckpt."):
                    inner.add(alias.name)
                else:
                    outer.add(alias.name.split(".")[0])
    inner.discard(name)
    return {m for m in inner if m in modules}, outer


def _levels(block_name: str, word: str) -> dict[str, int]:
    """docs/architecture.md's ```<block_name> block: ``<word> N: a, b, ...`` lines, name -> N."""
    text = open(os.path.join(HERE, "docs", "architecture.md")).read()
    block = re.search(rf"```{block_name}\n(.*?)```", text, re.S)
    assert block, f"docs/architecture.md has no ```{block_name} block"
    levels: dict[str, int] = {}
    for line in block.group(1).strip().splitlines():
        m = re.fullmatch(rf"{word} (\d+): (.+)", line.strip())
        assert m, f"unreadable {block_name} line: {line!r}"
        for item in (x.strip() for x in m.group(2).split(",")):
            assert item not in levels, f"{item} is on two {block_name}"
            levels[item] = int(m.group(1))
    return levels


def _floors() -> dict[str, int]:
    return _levels("floors", "floor")


#: The packages whose modules on one floor may import each other (docs/architecture.md, "Floors"):
#: a backend family's modules, the CLI's commands, an integration's rooms. Nowhere else does an
#: import stay on its floor.
SIBLING_PACKAGES = ("txckpt._storage", "txckpt._cli", "txckpt.integrations")


def _package(mod: str) -> str:
    # txckpt._storage (the package's __init__) belongs to the storage package, like its modules.
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else mod


def test_every_module_is_on_one_floor():
    floors, modules = _floors(), _modules()
    assert sorted(set(modules) - set(floors)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(floors) - set(modules)) == [], "docs/architecture.md names modules that do not exist"


def test_imports_run_down_the_floors():
    floors, modules = _floors(), _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        for dep in sorted(_imports(name, path, modules)[0]):
            if name not in floors or dep not in floors:
                continue  # reported by test_every_module_is_on_one_floor
            below = floors[dep] < floors[name]
            sibling = floors[dep] == floors[name] and _package(dep) == _package(name) in SIBLING_PACKAGES
            if not (below or sibling):
                wrong.append(f"{name} (floor {floors[name]}) imports {dep} (floor {floors[dep]})")
    assert wrong == []


def test_no_import_cycle():
    modules = _modules()
    graph = {n: _imports(n, p, modules)[0] for n, p in modules.items()}
    # Tarjan's strongly connected components; any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            # A package and its submodules (txckpt.cli -> txckpt._cli.app -> txckpt._cli.common)
            # are not a cycle unless a submodule imports the package back.
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_names_its_concept(name):
    path = _modules()[name]
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    first = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    assert first, f"{path} has no docstring: its first line names the one concept the module owns"


def test_core_imports_no_framework():
    modules = _modules()
    bad = []
    for name, path in sorted(modules.items()):
        if name.startswith("txckpt.integrations"):
            continue
        outer = _imports(name, path, modules)[1]
        bad += [f"{name} imports {fw}" for fw in FRAMEWORKS if fw in outer]
    assert bad == []


# ----- imports at the top of their modules (issue 28) ---------------------------------------------
def _function_imports(source: str, path: str = "<src>") -> list[int]:
    """The lines of the imports nested anywhere inside a function (``def`` or ``async def``, a
    method, a nested function, under ``if``/``try``) of ``source``, each import once."""
    tree = ast.parse(source, path)
    found: dict[int, int] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[id(node)] = node.lineno
    return sorted(found.values())


def _function_import_counts(pkg: str = PKG) -> dict[str, int]:
    """{file under ``pkg``'s parent: its imports inside functions}, files with none left out."""
    counts = {}
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                n = len(_function_imports(open(path).read(), path))
                if n:
                    counts[os.path.relpath(path, os.path.dirname(pkg))] = n
    return counts


def test_the_function_import_counter_sees_every_nesting():
    """The counter below is not vacuous: imports in functions, methods, nested functions and
    coroutines, under if/try, count once each; module and class-body imports do not."""
    src = (
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
        "def f():\n"
        "    import a\n"
        "    def g():\n"
        "        from b import c\n"
        "class K:\n"
        "    import d\n"
        "    def m(self):\n"
        "        if self:\n"
        "            import e.f as ef\n"
        "    async def n(self):\n"
        "        try:\n"
        "            from . import h\n"
        "        except ImportError:\n"
        "            pass\n"
    )
    assert _function_imports(src) == [6, 8, 13, 16]


def test_imports_are_at_the_top_of_their_modules():
    """At most MAX_FUNCTION_IMPORTS imports inside functions in txckpt/ (there were 129): an
    import that dodged a cycle or an upward import is a structure to fix (move the code to the
    floor that owns it); one that waits for first use goes through txckpt/_base/deps.py."""
    counts = _function_import_counts()
    total = sum(counts.values())
    by_file = ", ".join(f"{p}: {n}" for p, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    assert total <= MAX_FUNCTION_IMPORTS, (
        f"txckpt/ has {total} imports inside functions (at most {MAX_FUNCTION_IMPORTS}): move them to the "
        f"top of their modules, or read a deferred module through txckpt/_base/deps.py ({by_file})"
    )


def test_import_txckpt_leaves_torch_and_the_backends_to_first_use():
    """In a fresh interpreter (torch, once imported, cannot be set aside in this one), neither
    ``import txckpt`` nor ``import txckpt.cli`` imports torch, torch.distributed, safetensors,
    fsspec or a backend, tqdm, or a framework."""
    code = (
        "import json, sys\n"
        "import txckpt\n"
        "first = sorted(sys.modules)\n"
        "import txckpt.cli\n"
        "print(json.dumps([first, sorted(sys.modules)]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    # A fresh interpreter, never the zygote (tests/harness/zygote.py): its children have torch and
    # transformers in sys.modules already, which is what this test looks for.
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    first, cli = json.loads(out.splitlines()[-1])
    unwanted = DEFERRED + FRAMEWORKS

    def loaded(names: list[str]) -> list[str]:
        return sorted(n for n in names if n.split(".")[0] in unwanted)

    assert (loaded(first), loaded(cli)) == ([], []), "import txckpt / import txckpt.cli imported these"


# ----- one parse of checkpoint names (issue 28) ---------------------------------------------------
#: The modules that form and parse checkpoint names (``<prefix><step>``, ``checkpoint-N``); every
#: other module asks them (Naming.public / step_of / name_of, split_public, layout.checkpoint_name,
#: parse_checkpoint_name, integrations/trainer/paths.TRAINER_NAMING).
NAME_MODULES = ("txckpt._base.naming", "txckpt._base.layout")
_PREFIX_TEXT = re.compile(r"checkpoint[-_]$")
#: A name formed from a prefix and a value: ``checkpoint-{}``, ``{PREFIX}-{}``, ``{PREFIX}{}``.
_FORMED = re.compile(r"(checkpoint[-_]|\{PREFIX\}[-_]?)\{\}")
_RE_FUNCS = {"compile", "match", "fullmatch", "search", "findall", "finditer", "sub", "subn", "split"}


def _render(node: ast.AST) -> str:
    """A string expression as text: constants as they are, a name of a prefix constant
    (PREFIX_CHECKPOINT_DIR, CHECKPOINT_PREFIX) as ``{PREFIX}``, any other value as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_render(v) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        return _render(node.value) if "PREFIX" in _render(node.value) else "{}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left) + _render(node.right)
    if isinstance(node, (ast.Name, ast.Attribute)):
        ident = node.id if isinstance(node, ast.Name) else node.attr
        return "{PREFIX}" if "PREFIX" in ident and "CHECKPOINT" in ident else "{}"
    return "{}"


def _name_violations(source: str, path: str = "<src>") -> list[str]:
    """Where ``source`` forms or parses a checkpoint name itself: an f-string, concatenation,
    ``%``/``.format`` template or literal of ``checkpoint-N``/``checkpoint_N``, a bare prefix
    literal outside ``Naming(...)``, or a regex over digits (a step number)."""
    tree = ast.parse(source, path)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    naming_args = {
        id(a)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Naming"
        for a in n.args
    }
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    inner |= {id(c) for n in ast.walk(tree) if isinstance(n, ast.BinOp) for c in (n.left, n.right)}
    out = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.JoinedStr, ast.BinOp)) and id(node) not in inner:
            text = _render(node)
            if _FORMED.search(text):
                out.append(f"{where}: forms a checkpoint name ({text!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            s = node.value
            if re.search(r"checkpoint[-_](%|\{)", s) or re.fullmatch(r"checkpoint[-_]\d+", s):
                out.append(f"{where}: a checkpoint name template or literal ({s!r})")
            elif (
                _PREFIX_TEXT.search(s)
                and s in ("checkpoint-", "checkpoint_")
                and id(node) not in naming_args
                and id(node) not in inner
            ):
                out.append(f"{where}: a checkpoint name prefix outside Naming(...) ({s!r})")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _RE_FUNCS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "re"
            and node.args
        ):
            pattern = _render(node.args[0])
            if "\\d" in pattern or "[0-9]" in pattern:
                out.append(f"{where}: a regex over a number ({pattern!r})")
    return out


def test_the_name_checker_sees_each_way_of_forming_or_parsing_a_name():
    """The checker below is not vacuous: each way the code used to form or parse names is caught."""
    bad = {
        'CHECKPOINT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\\d+)$")': "regex",
        '_PUBLIC_RE = re.compile(r"^(?P<root>.*)/(?P<name>[^/.][^/]*?)(?P<step>\\d+)$")': "regex",
        'd = os.path.join(base, f"checkpoint-{step}")': "forms",
        'd = f"{PREFIX_CHECKPOINT_DIR}-{m.step}"': "forms",
        'd = f"checkpoint_{i}"': "forms",
        'd = "checkpoint-" + str(step)': "forms",
        'log.info("checkpoint-%d is already committed", step)': "template",
        'print(" -> ".join(f\'"checkpoint-{s} (legacy)"\' for s in legacy))': "forms",
        'p = os.path.join(root, "checkpoint-2")': "literal",
        'ok = name.startswith("checkpoint_")': "prefix",
    }
    for src, kind in bad.items():
        found = _name_violations(src)
        assert len(found) == 1 and kind in found[0], (src, found)
    fine = [
        'ACCELERATE_NAMING = Naming("checkpoint_")',
        'TRAINER_NAMING = Naming(PREFIX_CHECKPOINT_DIR + "-")',
        "name = naming.public(step)",
        '"""a docstring about checkpoint-{step} and checkpoint-N"""',
        'log.info("%s is committed; not saving checkpoint-N again", name)',
        'r = re.compile(re.escape(prefix) + r"[0-9a-f]{12}$")',
    ]
    for src in fine:
        assert _name_violations(src) == [], src


def test_checkpoint_names_are_formed_and_parsed_only_by_naming_and_layout():
    """layout.py calls parse_checkpoint_name "the one parse": no other module of txckpt/ (core or
    integration) forms ``checkpoint-N``/``<prefix>N`` or parses a step out of a name itself, so a
    root's own naming (an Accelerate root's ``checkpoint_N``) is never misnamed ``checkpoint-N``."""
    found = []
    for name, path in sorted(_modules().items()):
        if name not in NAME_MODULES:
            found += _name_violations(open(path).read(), os.path.relpath(path, HERE))
    assert found == []


# ----- the root and the storage are typed in the core (issue 28) ----------------------------------
def _is_root_or_storage(name: str) -> bool:
    return name in ("root", "storage") or name.endswith(("_root", "_storage"))


def _untyped_root_params(source: str, path: str = "<src>") -> list[str]:
    """Parameters named root/storage (or ``*_root``/``*_storage``) of ``source``'s functions and
    lambdas that are unannotated or annotated ``Any`` (``Any``, ``typing.Any``, ``"Any"``)."""
    tree = ast.parse(source, path)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = fn.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            if not _is_root_or_storage(arg.arg):
                continue
            ann = arg.annotation
            text = None if ann is None else (ann.value if isinstance(ann, ast.Constant) else ast.unparse(ann))
            if text is None or text in ("Any", "typing.Any"):
                out.append(f"{path}:{fn.lineno} {getattr(fn, 'name', '<lambda>')}({arg.arg}: {text})")
    return out


def test_the_root_parameter_checker_sees_unannotated_and_any():
    """The checker below is not vacuous."""
    src = (
        "from typing import Any\n"
        "def a(root): pass\n"
        "def b(storage: Any): pass\n"
        "def c(x, *, dest_root: 'Any'): pass\n"
        "f = lambda storage: storage\n"
        "class K:\n"
        "    def m(self, src_storage: typing.Any): pass\n"
        "def ok(root: 'Root', storage: Storage, rooted: Any, storage_options: Any): pass\n"
    )
    assert [line.split()[1] for line in _untyped_root_params(src)] == [
        "a(root:",
        "b(storage:",
        "c(dest_root:",
        "<lambda>(storage:",
        "m(src_storage:",
    ]


def test_the_core_types_every_root_and_storage_parameter():
    """No parameter named root/storage (``*_root``/``*_storage``) in the core (txckpt/ but its
    integrations) is unannotated or ``Any``: mypy (``make typecheck``) then checks every use of
    one against the Protocol or class it is (publication.Root, storage.base.Storage, ...)."""
    found = []
    for name, path in sorted(_modules().items()):
        if not name.startswith("txckpt.integrations"):
            found += _untyped_root_params(open(path).read(), os.path.relpath(path, HERE))
    assert found == []


TESTS = os.path.join(HERE, "tests")
#: Modules outside tests/children/ that may be entry points, and why: the reliability campaign is a
#: program of its own (``python -m tests.reliability``), and two of its cases are both the case (a
#: library its runner imports, their main role) and the child process the case starts.
ENTRY_POINTS_ELSEWHERE = {
    "tests/reliability/__main__.py": "the campaign's command line",
    "tests/reliability/s3.py": "the campaign's S3 server process (python -m tests.reliability.s3)",
    "tests/reliability/atexit_save.py": "the async-atexit case and its interpreter (python -m ...)",
}


def _has_main_block(source: str) -> bool:
    """Whether a module has a top-level ``if __name__ == "__main__":`` (either way round)."""
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)
        ):
            sides = [node.test.left, *node.test.comparators]
            names = {s.id for s in sides if isinstance(s, ast.Name)}
            consts = {s.value for s in sides if isinstance(s, ast.Constant)}
            if names == {"__name__"} and consts == {"__main__"}:
                return True
    return False


def test_the_main_block_finder_sees_both_spellings():
    assert _has_main_block('if __name__ == "__main__":\n    main()\n')
    assert _has_main_block("if '__main__' == __name__:\n    pass\n")
    assert not _has_main_block('def f():\n    if __name__ == "__main__":\n        pass\n')
    assert not _has_main_block('S = """\nif __name__ == "__main__":\n    main()\n"""\n')


def test_child_process_entry_points_live_in_tests_children():
    """tests/children/__init__.py's rule: a module of tests/ that a child process starts from (a
    ``__main__`` block, or a ``__main__.py``) lives in tests/children/; libraries live in
    tests/harness/. The few exceptions are listed, each with its reason."""
    found = []
    for dirpath, dirnames, filenames in os.walk(TESTS):
        dirnames[:] = [d for d in dirnames if d not in ("children", "__pycache__", "data")]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, HERE)
            if rel in ENTRY_POINTS_ELSEWHERE:
                continue
            if fn == "__main__.py" or _has_main_block(open(path).read()):
                found.append(rel)
    assert found == [], f"entry points outside tests/children/ (move them there): {found}"
    for rel in ENTRY_POINTS_ELSEWHERE:  # an exception that stopped being one is removed from the list
        assert _has_main_block(open(os.path.join(HERE, rel)).read()), rel


# ----- folders (issue 46): public paths, private rooms, one way down, one seam ------------------

#: The modules users may import (docs/api.md, "Public modules"), and the two entry points run as
#: ``python -m``; every other module has a ``_``-prefixed part in its path.
PUBLIC_MODULES = (
    "txckpt",
    "txckpt.errors",
    "txckpt.preemption",
    "txckpt.cli",
    "txckpt.integrations",
    "txckpt.integrations.transformers",
    "txckpt.integrations.accelerate",
    "txckpt.integrations.dcp",
    "txckpt.integrations.lightning",
)
ENTRY_POINTS = ("txckpt.__main__", "txckpt.demo")
#: The backend families; only txckpt._storage (which chooses one) and they themselves import them.
BACKENDS = ("txckpt._storage.local", "txckpt._storage.fsspec", "txckpt._storage.s3")


def _folders() -> dict[str, int]:
    return _levels("folders", "level")


def _folder_of(mod: str, levels: dict[str, int]) -> str:
    """The longest folder of the block that ``mod`` is or lies in."""
    # The package itself ("txckpt") is a folder of one module: a new _package must name its level.
    owners = [f for f in levels if mod == f or (mod.startswith(f + ".") and f != "txckpt")]
    assert owners, f"{mod} lies in no folder of docs/architecture.md's folders block"
    return max(owners, key=len)


def _under(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def test_every_internal_module_is_private():
    public = set(PUBLIC_MODULES) | set(ENTRY_POINTS)
    exposed = [m for m in _modules() if m not in public and not any(p.startswith("_") for p in m.split(".")[1:])]
    assert exposed == [], "internal modules without a _-prefixed part in their path"


def test_folders_import_one_way_down():
    levels, modules = _folders(), _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        mine = _folder_of(name, levels)
        for dep in sorted(_imports(name, path, modules)[0]):
            theirs = _folder_of(dep, levels)
            if theirs != mine and levels[theirs] >= levels[mine]:
                wrong.append(f"{name} ({mine}, level {levels[mine]}) imports {dep} ({theirs}, level {levels[theirs]})")
    assert wrong == []


def test_no_backend_import_above_storage():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        if _under(name, "txckpt._storage"):
            continue  # the seam itself: open_storage chooses, a family imports its own modules
        for dep in sorted(_imports(name, path, modules)[0]):
            if any(_under(dep, b) for b in BACKENDS):
                wrong.append(f"{name} imports {dep}")
    assert wrong == [], "backend knowledge above storage/: ask the Storage instead"


def test_internal_all_lists_only_what_the_module_defines():
    """One address per name: an internal module does not re-export another module's names
    (integrations/_dcp/compat.py excepted: it is the one place that names torch's private DCP
    helpers, which it re-exports by design)."""
    public = set(PUBLIC_MODULES) | set(ENTRY_POINTS)
    wrong = []
    for name, path in sorted(_modules().items()):
        if name in public or name == "txckpt.integrations._dcp.compat":
            continue
        tree = ast.parse(open(path).read())
        defined, listed = set(), []
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = list(ast.literal_eval(node.value))
        wrong += [f"{name}.{n}" for n in listed if n not in defined]
    assert wrong == [], "re-exported names: import them from the module that defines them"


def test_no_private_name_crosses_modules():
    """A ``_name`` is its module's own: no txckpt module imports another's (the S3 family's
    uploads and reads, the verify engine's messages, gc's removal and the Trainer's torch.save
    settings were; integrations/_dcp/compat.py is the one module that names torch's private DCP
    helpers, and its importers take those names from it)."""
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = _from_module(node, name, path)
            if not (mod == "txckpt" or mod.startswith("txckpt.")) or mod == "txckpt.integrations._dcp.compat":
                continue  # compat's _names are torch's private helpers, re-exported by design
            for alias in node.names:
                if (
                    alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and f"{mod}.{alias.name}" not in modules
                ):
                    wrong.append(f"{name} imports {mod}.{alias.name}")
    assert wrong == []
