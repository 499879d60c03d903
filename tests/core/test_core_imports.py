"""slurm_mapa/core: its import graph has no cycle, and it imports nothing from the Slurm, replay or
hardware-discovery packages (the core is pure: the Prolog, the replay and the CLI all call it).

The graph is read from the modules' ASTs, not by importing them: every ``import`` statement counts,
module level or inside a function, so a cycle hidden behind a function-level import is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import slurm_mapa.core

CORE = Path(slurm_mapa.core.__file__).parent
PACKAGE = "slurm_mapa.core"
FORBIDDEN = ("slurm_mapa.slurm", "slurm_mapa.replay", "slurm_mapa.hardware")


def module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, as an absolute name (``from . import x`` counts ``x`` as a module)."""
    package = PACKAGE.split(".")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(part for part in (base, node.module) if part)
            found.add(target)
            if node.module is None:
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def core_graph() -> dict[str, set[str]]:
    """slurm_mapa.core.X -> the core modules it imports (itself and the package's ``__init__`` left out)."""
    modules = {module_name(path): path for path in sorted(CORE.glob("*.py"))}
    return {
        name: {target for target in imported_modules(path) if target in modules and target not in (name, PACKAGE)}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # absent: unseen; "open": on the current path; "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from .a import A\nfrom ..core.b import B\nfrom .. import replay\n\ndef f():\n    from .c import C\n")
    assert imported_modules(source) == {
        "slurm_mapa.core.a", "slurm_mapa.core.b", "slurm_mapa.core.c", "slurm_mapa", "slurm_mapa.replay",
    }


def test_the_core_import_graph_has_no_cycle():
    graph = core_graph()
    assert len(graph) > 10, sorted(graph)  # the glob found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in slurm_mapa/core: " + " -> ".join(name.rsplit(".", 1)[-1] for name in cycle)


def test_the_core_imports_nothing_from_slurm_replay_or_hardware_discovery():
    wrong = {
        f"{path.name}: {target}"
        for path in sorted(CORE.glob("*.py"))
        for target in imported_modules(path)
        if any(target == name or target.startswith(name + ".") for name in FORBIDDEN)
    }
    assert not wrong, sorted(wrong)


def test_the_prolog_imports_no_numpy_until_a_decision_needs_it():
    """The in-process Prolog imports the policies for every job; numpy (about 0.1 s) is loaded only
    by what needs it (a ring rate, the 16-GPU subset tables), never by the imports themselves."""
    import subprocess
    import sys

    code = ("import sys; import slurm_mapa.slurm.hooks.prolog, slurm_mapa.core.policies, slurm_mapa.core.ring_choice; "
            "print('numpy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
