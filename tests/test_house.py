"""The shape of the house: the import graph flows one way between its parts (mesh -> models ->
checkpoint -> train's data, core, run and cli -> plan reads the core), no module imports itself back
through others, no module reaches into another's private names, no source file outgrows a room,
no function outgrows a screen without saying why, the Trainer stays small, the README's "Where
things are" map names files and functions that exist and shows the part table, and the docs and
code speak of the project alone."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mesh", "models", "checkpoint", "train", "plan")
# The parts of the house and what each may import from the project besides itself and the
# top-level errors module; a module belongs to the longest part that names it. README.md's "Where
# things are" shows this table (test_the_readme_shows_the_part_table).
PARTS = {
    "mesh": set(),
    "models": {"mesh"},
    "checkpoint": {"mesh", "models"},
    # the tokens: no model, no step, no run
    "train.data": {"checkpoint"},
    # the step and its setup
    "train.core": {"mesh", "models", "checkpoint", "train.data"},
    # the run around the step
    "train.run": {"mesh", "models", "checkpoint", "train.data", "train.core"},
    # the entry points: imported by nothing but each other and the doorways
    "train.cli": {"mesh", "models", "checkpoint", "train.data", "train.core", "train.run"},
    # the doorways `python -m train` and `python -m train.harness`
    "train": {"train.cli"},
    # plans the step: never the run or the loop
    "plan": {"mesh", "models", "checkpoint", "train.data", "train.core"},
    # checks a cluster and a run's inputs before the run: asks the run's own checks (run dir,
    # resume point, the coordination client), runs no step and no loop
    "plan.doctor": {
        "mesh",
        "models",
        "checkpoint",
        "train.data",
        "train.core",
        "train.run",
        "plan",
    },
}
# Imports across the table, each for its reason.
CROSSINGS = {
    # fault injection's one seam: a drill's NaN steps are the pipeline's loss weights
    ("train.data.pipeline", "train.run.faults"),
    # `python -m train plan` runs plan's command line
    ("train.cli.main", "plan.cli"),
    # `python -m train doctor` runs the doctor's command line
    ("train.cli.main", "plan.doctor.main"),
}
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


def _part(mod: str) -> str:
    """The part of the house `mod` belongs to ("errors" for the top-level module)."""
    names = [p for p in PARTS if mod == p or mod.startswith(p + ".")]
    return max(names, key=len) if names else mod


def test_imports_flow_one_way():
    wrong = []
    for mod, deps in _graph().items():
        part = _part(mod)
        for dep in deps:
            dep_part = _part(dep)
            if dep_part in (part, "errors") or (mod, dep) in CROSSINGS:
                continue
            if dep_part not in PARTS.get(part, set()):
                wrong.append(f"{mod} ({part}) imports {dep} ({dep_part})")
    assert not wrong, wrong


def test_the_readme_shows_the_part_table():
    """README's "Where things are" has the table above, as `| `train/core/` | mesh, models, ... |`
    rows: a part added, dropped or allowed more here must be said there too."""
    section = open(os.path.join(ROOT, "README.md")).read().split("\n## Where things are\n", 1)[1]
    rows = re.findall(r"^\| `([\w/]+)/` \| ([^|]*) \|", section.split("\n## ", 1)[0], flags=re.M)
    shown = {
        path.replace("/", "."): {
            p.strip().strip("`").rstrip("/").replace("/", ".")
            for p in deps.split(",")
            if p.strip() not in ("", "nothing")
        }
        for path, deps in rows
    }
    assert shown == PARTS, (shown, PARTS)


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
    r"(?-i:\bMISSION\b)|JAX_FACTS|DESIGN\.md|PEERS\.md|\btest_mission\b|\bthe seeds\b|\bseeds'"
    r"|\bissue \d+\b|\bthe (pipeline|data|MoE|performance|architecture) issue\b"
    r"|\bsessions?\b|\bagents?\b|\blent\b",
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


# ------------------------------------------------------------------ rooms: the Trainer, functions

TRAINER_AT_MOST = 199  # lines of the class, its docstrings included


def _trainer() -> ast.ClassDef:
    tree = ast.parse(open(os.path.join(ROOT, "train", "run", "loop.py")).read())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def test_the_trainer_stays_small():
    trainer = _trainer()
    assert trainer.end_lineno - trainer.lineno + 1 <= TRAINER_AT_MOST


def test_the_trainer_passes_no_call_on():
    """A method whose whole body returns one call or attribute (`return compile_step(self.setup,
    ...)`, `return self.setup.dp_axes`) is a second name for something its callers can reach
    themselves (`trainer.setup`, the function); a cached property caches, so it is not one."""
    passing = []
    for f in _trainer().body:
        if not isinstance(f, ast.FunctionDef) or f.decorator_list:
            continue
        body = f.body[1:] if ast.get_docstring(f) is not None else f.body
        if (
            len(body) == 1
            and isinstance(body[0], ast.Return)
            and isinstance(body[0].value, (ast.Call, ast.Attribute))
        ):
            passing.append(f.name)
    assert not passing, passing


MAX_FUNCTION_LINES = 60
# A longer function says why in a comment among its first lines, e.g. "# One function on purpose
# (~70 lines): ...".
WHY = re.compile(r"#.*\bon purpose\b")
# Functions that were longer before the rule and have not been split or explained yet, with the
# length each may not grow past. Split one (or give it its why) and drop it here: the test fails
# while a row names a function that no longer needs it.
PENDING = {
    "models/context.py::_ring": 68,
}


def _long_functions() -> dict[str, tuple[int, bool]]:
    """path::name -> (lines, whether its first lines say why), for every function over
    MAX_FUNCTION_LINES in the source tree (the packages, errors.py, benchmarks/; not tests/)."""
    files = [os.path.join(ROOT, "errors.py")] + [
        os.path.join(dirpath, f)
        for top in (*PACKAGES, "benchmarks")
        for dirpath, _, names in os.walk(os.path.join(ROOT, top))
        for f in names
        if f.endswith(".py")
    ]
    out = {}
    for path in files:
        source = open(path).read()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                first = node.body[1] if ast.get_docstring(node) is not None else node.body[0]
                head = lines[node.lineno - 1 : min(first.lineno + 2, node.end_lineno)]
                key = f"{os.path.relpath(path, ROOT)}::{node.name}"
                out[key] = (n, any(WHY.search(line) for line in head))
    return out


def test_no_function_outgrows_a_screen_without_saying_why():
    found = _long_functions()
    unexplained = {
        k: n for k, (n, why) in found.items() if not why and n > PENDING.get(k, MAX_FUNCTION_LINES)
    }
    assert not unexplained, f"over {MAX_FUNCTION_LINES} lines without a why: {unexplained}"
    settled = [k for k in PENDING if k not in found or found[k][1]]
    assert not settled, f"split or explained now: drop from PENDING: {settled}"
