"""The layout docs/architecture.md describes, checked from the modules' ASTs (every import
statement counts, module level or inside a function):

* the parts of ``slurm_mapa.slurm`` import only the parts below them;
* the node's state files are behind one door: nothing outside ``slurm_mapa.slurm.node_state``
  imports its modules, only the package;
* the agent's client, which root runs as a script with ``python -I -S``, imports nothing of the
  project;
* no module is over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import slurm_mapa

PACKAGE_DIR = Path(slurm_mapa.__file__).parent
SLURM = "slurm_mapa.slurm"

# Lower layers first; a module may import its own layer and those before it.
LAYERS = (
    ("text", "trusted_files", "ring_rate_cache"),
    ("config",),
    ("node_state",),
    ("isolation",),
    ("hooks",),
    ("agent",),
    ("admin",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}

MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, as an absolute name (``from . import x`` counts ``x`` too)."""
    name = module_name(path)
    package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(part for part in (base, node.module) if part)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def slurm_part(module: str) -> str | None:
    """``node_state`` for slurm_mapa.slurm.node_state.ledger; None outside slurm_mapa.slurm."""
    if not module.startswith(SLURM + "."):
        return None
    return module[len(SLURM) + 1:].split(".")[0]


def test_every_part_of_the_slurm_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in (PACKAGE_DIR / "slurm").iterdir()
             if p.name not in ("__init__.py", "__pycache__")}
    assert parts == set(RANK), "a new part of slurm_mapa/slurm needs its place in LAYERS (and docs/architecture.md)"


def test_the_parts_of_the_slurm_package_import_only_the_parts_below_them():
    wrong = []
    for path in modules():
        importer = slurm_part(module_name(path))
        if importer is None:
            continue
        for target in imported_modules(path):
            part = slurm_part(target)
            if part is not None and part in RANK and RANK[part] > RANK[importer]:
                wrong.append(f"{module_name(path)} imports {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_only_the_node_state_package_opens_its_modules():
    door = f"{SLURM}.node_state"
    inner = {module_name(p) for p in (PACKAGE_DIR / "slurm" / "node_state").glob("*.py")} - {door}
    wrong = []
    for path in modules():
        name = module_name(path)
        if name == door or name.startswith(door + "."):
            continue
        wrong += [f"{name} imports {target}" for target in imported_modules(path) if target in inner]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_agent_client_imports_nothing_of_the_project():
    client = PACKAGE_DIR / "slurm" / "agent" / "client.py"
    assert not {t for t in imported_modules(client) if t.startswith("slurm_mapa")}


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE_DIR.parent)))
def test_no_module_is_much_longer_than_a_reader_holds(path):
    relative = str(path.relative_to(PACKAGE_DIR.parent))
    lines = len(path.read_bytes().splitlines())
    assert lines <= MAX_LINES, f"{relative} has {lines} lines: split it by responsibility (docs/architecture.md)"


def test_the_import_checks_see_a_violation():
    """The checks above read imports the way Python resolves them (a check that sees nothing
    would pass forever)."""
    prolog = PACKAGE_DIR / "slurm" / "hooks" / "prolog.py"
    found = imported_modules(prolog)
    assert f"{SLURM}.node_state" in found and f"{SLURM}.node_state.NodeState" in found
    assert RANK["agent"] > RANK["hooks"] and slurm_part(f"{SLURM}.agent.service") == "agent"


def sibling_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> the modules it imports): its strongly connected
    components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_back_a_sibling_that_imports_it():
    """Issue 42: no circle inside a package (imports for type checking included), so each module
    reads with only what it imports; a package's __init__ gathering its modules is not a circle."""
    named = {module_name(path): path for path in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in named.items():
        if path.stem == "__init__":
            continue
        package = name.rsplit(".", 1)[0]
        siblings = set()
        for imported in imported_modules(path):
            while imported and imported not in named:
                imported = imported.rsplit(".", 1)[0] if "." in imported else ""
            if imported and imported != name and named[imported].stem != "__init__" and imported.rsplit(".", 1)[0] == package:
                siblings.add(imported)
        graph[name] = siblings
    assert sibling_cycles(graph) == []
    assert sibling_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check sees one


# --- the tests' tree ------------------------------------------------------------------------------
TESTS_DIR = Path(__file__).resolve().parent
NOT_A_PACKAGE_PART = {"cluster", "data", "lua"}  # the mini cluster's suite, test inputs, the Lua driver


def test_the_tests_tree_mirrors_the_package():
    """tests/core/ holds core's tests, tests/slurm/agent/ the agent's, ...: every folder of tests
    names a part of the package, and every package (and each package of slurm/) has its folder."""
    folders = {p.relative_to(TESTS_DIR) for p in TESTS_DIR.rglob("*") if p.is_dir() and "__pycache__" not in p.parts
               and p.relative_to(TESTS_DIR).parts[0] not in NOT_A_PACKAGE_PART and not p.name.startswith(".")}
    assert folders, "no test folders seen"
    for folder in folders:
        assert (PACKAGE_DIR / folder).is_dir(), f"tests/{folder} names no part of slurm_mapa"
        assert list((TESTS_DIR / folder).glob("test_*.py")) or any(
            f.parent == folder for f in folders), f"tests/{folder} holds no tests"
    packages = {Path(p.name) for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file()}
    packages |= {Path("slurm") / p.name for p in (PACKAGE_DIR / "slurm").iterdir() if (p / "__init__.py").is_file()}
    assert packages - folders == set(), "a package without its folder of tests"


def test_no_two_test_files_share_a_name():
    """The test folders have no __init__.py, so pytest imports each test file by its name alone: a
    second file of the same name in another folder fails to collect ("import file mismatch")."""
    seen: dict[str, Path] = {}
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        if "__pycache__" in path.parts:
            continue
        assert path.name not in seen, f"{path.relative_to(TESTS_DIR)} and {seen[path.name].relative_to(TESTS_DIR)} share a name"
        seen[path.name] = path
    assert len(seen) > 50, "too few test files seen"
