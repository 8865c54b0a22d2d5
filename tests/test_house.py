"""The shape of the house: the import graph flows one way (mesh -> models -> checkpoint -> train
-> plan), no module imports itself back through others, no module reaches into another's private
names, no source file outgrows a room, and the README's "Where things are" map names files and
functions that exist."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mesh", "models", "checkpoint", "train", "plan")
# what each package may import from the project (besides itself and the top-level errors module)
ALLOWED = {
    "mesh": set(),
    "models": {"mesh"},
    "checkpoint": {"mesh", "models"},
    "train": {"mesh", "models", "checkpoint"},
    "plan": {"mesh", "models", "checkpoint", "train"},
}
# The entry points that dispatch to a package above them: `python -m train plan` runs plan's CLI.
CLI_DISPATCH = {("train.cli.main", "plan")}
# Deprecated aliases that import upward, inside a function run only when an old name is asked for:
# models.hf's module __getattr__ (models/hf_moved.py) hands out the names that moved to
# checkpoint.hf and checkpoint.hf_files (with a DeprecationWarning, for one release). Nothing
# imports them at module level, so neither the layering nor the import order changes; remove the
# rows with the alias.
DEPRECATED_ALIASES = {
    ("models.hf_moved", "checkpoint.hf"),
    ("models.hf_moved", "checkpoint.hf_files"),
}
MAX_LINES = 400


def _modules() -> dict[str, str]:
    """module name -> file, for every source file of the packages and the top-level modules."""
    out = {"errors": os.path.join(ROOT, "errors.py")}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _imports(path: str, known: set[str]) -> set[str]:
    """The project modules `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import sub` depends on the submodule; `from mod import name`, on mod
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: _imports(f, set(mods)) - {m} for m, f in mods.items()}
    for mod, dep in DEPRECATED_ALIASES:
        assert dep in graph[mod], f"{mod} no longer imports {dep}: drop it from DEPRECATED_ALIASES"
        graph[mod].discard(dep)
    return graph


def test_imports_flow_one_way():
    wrong = []
    for mod, deps in _graph().items():
        pkg = mod.split(".")[0]
        for dep in deps:
            dep_pkg = dep.split(".")[0]
            if dep_pkg in (pkg, "errors") or pkg == "errors" and dep_pkg == "errors":
                continue
            if dep_pkg not in ALLOWED.get(pkg, set()) and (mod, dep_pkg) not in CLI_DISPATCH:
                wrong.append(f"{mod} imports {dep}")
    assert not wrong, wrong


def test_no_import_cycle():
    # a submodule importing its own package's __init__ (which re-exports it) is no cycle
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in _graph().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_source_file_outgrows_a_room():
    big = {m: n for m, f in _modules().items() if (n := sum(1 for _ in open(f))) > MAX_LINES}
    assert not big, big


def _map_rows() -> list[tuple[str, str, str]]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|([^|`]+)\|\s*`([^`]+)`\s*\|\s*`([^`]+)`\s*\|", section, flags=re.M)
    return [(what.strip(), path, name) for what, path, name in rows]


def _defines(path: str, name: str) -> bool:
    """Whether the module at `path` defines `name` (a function, class or assignment at module
    level) or, for `Class.member`, the class defines that member."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    head, _, member = name.partition(".")

    def names_in(body) -> dict[str, ast.AST]:
        out = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out[n.id] = node
        return out

    top = names_in(tree.body)
    if head not in top:
        return False
    return not member or (
        isinstance(top[head], ast.ClassDef) and member in names_in(top[head].body)
    )


def test_the_readme_map_names_what_exists():
    rows = _map_rows()
    concepts = {what.split("(")[0].strip().lower() for what, _, _ in rows}
    # the places a newcomer looks for first
    for needed in (
        "mesh rules",
        "model",
        "state",
        "step",
        "loop",
        "resume",
        "checkpoint layout",
        "plan",
        "data",
    ):
        assert any(c.startswith(needed) for c in concepts), (
            f"the map has no row for {needed}: {sorted(concepts)}"
        )
    missing = [
        f"{path}: {name} ({what})"
        for what, path, name in rows
        if not os.path.isfile(os.path.join(ROOT, path)) or not _defines(path, name)
    ]
    assert not missing, missing


# Phrases that point outside the repository: files it does not ship, or a tracker's numbering.
OUTSIDE = re.compile(
    r"MISSION\.md|JAX_FACTS|DESIGN\.md|PEERS\.md|\bthe seeds\b|\bseeds'|\bissue \d+\b"
    r"|\bthe (pipeline|data|MoE|performance|architecture) issue\b",
    re.I,
)
SHIPPED_TEXT = (".py", ".md", ".yaml", ".ipynb", ".sbatch", ".toml")


def test_the_docs_and_code_speak_of_the_project_alone():
    found = []
    for top in (
        "README.md",
        "BENCHMARKS.md",
        "pyproject.toml",
        "errors.py",
        *PACKAGES,
        "docs",
        "configs",
        "examples",
        "benchmarks",
        "tests",
    ):
        for dirpath, _, files in (
            os.walk(os.path.join(ROOT, top))
            if os.path.isdir(os.path.join(ROOT, top))
            else [(ROOT, [], [top])]
        ):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(SHIPPED_TEXT) and path != os.path.abspath(__file__):
                    for n, line in enumerate(open(path, errors="replace"), 1):
                        if OUTSIDE.search(line):
                            found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_no_module_reaches_into_another_modules_private_names():
    """A name with a leading underscore belongs to its module alone: a helper that two modules
    share gets a public name (`from x import _y` or `x._y` in another module is refused)."""
    mods = _modules()
    wrong = []
    for mod, path in mods.items():
        tree = ast.parse(open(path).read())
        aliases = {}  # a local name bound to another project module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif node.module in mods and _private(a.name):
                        wrong.append(f"{mod}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases |= {a.asname: a.name for a in node.names if a.asname and a.name in mods}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id, mod) != mod
                and _private(node.attr)
            ):
                wrong.append(f"{mod}: {node.value.id}.{node.attr}")
    assert not wrong, wrong


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
