"""The arrows of docs/ARCHITECTURE.md, read from the source: every import in the product
(function-local ones included, since a lazy import that closes a circle is still a circle)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = (
    "shardings",
    "zoo",
    "data",
    "checkpoint",
    "runtime",
    "training",
    "launch",
    "evaluation",
    "planning",
    "export",
    "serving",
    "configs",
    "errors",
)
FAMILIES = {
    d
    for d in os.listdir(os.path.join(ROOT, "zoo"))
    if d not in ("layers", "__pycache__") and os.path.isdir(os.path.join(ROOT, "zoo", d))
}


# The run machinery lives in one namespace (nnx_zoo/); the card's packages stay at the top.
NAMESPACE = "nnx_zoo"
_TOP = ("shardings", "zoo", "configs")


def _folder(package: str) -> str:
    return package if package in _TOP else os.path.join(NAMESPACE, package)


def _modules() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        single = os.path.join(ROOT, _folder(package) + ".py")
        if os.path.isfile(single):  # a package of one module (nnx_zoo/errors.py)
            out[f"{NAMESPACE}.{package}"] = single
            continue
        for folder, _, files in os.walk(os.path.join(ROOT, _folder(package))):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[module.removesuffix(".__init__")] = path
    return out


def _imports(path: str, known: set[str]) -> set[str]:
    """The product modules `path` imports (a `from pkg import name` that names a submodule
    counts as that submodule)."""
    found = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in known] or [node.module]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


GRAPH = {m: _imports(p, set(_modules())) for m, p in _modules().items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == NAMESPACE and len(parts) > 1 else parts[0]


def _is_package_init(module: str) -> bool:
    return module in _TOP or module == f"{NAMESPACE}.{_package(module)}"


def test_no_module_imports_itself_through_a_circle():
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module, path):
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            # A package's __init__ importing its own submodules is how packages export.
            if _is_package_init(module) and _package(dep) == _package(module) or dep == module:
                continue
            assert state.get(dep) != 1, "import circle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])


def _package_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of packages in `graph` (package -> packages it imports), as the path that
    closes it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(package, path):
        state[package] = 1
        for dep in sorted(graph.get(package, ())):
            if state.get(dep) == 1:
                return [*path, package, dep]
            if dep not in state and (found := visit(dep, [*path, package])):
                return found
        state[package] = 2
        return None

    for package in sorted(graph):
        if package not in state and (found := visit(package, [])):
            return found
    return None


def _package_graph() -> dict[str, set[str]]:
    """Every module collapsed to its package: package -> the other packages it imports."""
    graph: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        package = _package(module)
        graph.setdefault(package, set()).update(_package(d) for d in deps if _package(d) != package)
    return graph


def test_no_package_imports_itself_through_a_circle():
    # Modules may be acyclic while their packages are not (training.metrics -> checkpoint,
    # checkpoint.resume -> training): a package is the unit a reader, and the wheel, takes.
    cycle = _package_cycle(_package_graph())
    assert cycle is None, "package import circle: " + " -> ".join(cycle)


def test_the_package_circle_check_finds_a_circle():
    assert _package_cycle({"checkpoint": {"training"}, "training": {"checkpoint"}}) == [
        "checkpoint",
        "training",
        "checkpoint",
    ]
    assert _package_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _package_cycle({"launch": {"training"}, "training": {"runtime"}}) is None


def test_the_model_zoo_imports_no_run_machinery():
    banned = {
        "training",
        "data",
        "checkpoint",
        "runtime",
        "launch",
        "evaluation",
        "planning",
        "export",
        "serving",
    }
    for module, deps in GRAPH.items():
        if _package(module) in ("zoo", "shardings"):
            bad = {d for d in deps if _package(d) in banned}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_training_never_imports_a_concrete_family():
    for module, deps in GRAPH.items():
        if _package(module) == "training":
            bad = {d for d in deps if d.startswith("zoo.") and d.split(".")[1] in FAMILIES}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_only_the_assembly_and_its_callers_import_launch():
    for module, deps in GRAPH.items():
        if any(_package(d) == "launch" for d in deps):
            assert _package(module) in ("launch", "evaluation", "planning", "export"), module


# docs/ARCHITECTURE.md's "may import" column, package by package (jax and the libraries aside).
# `errors` (the one UsageError) sits below everything: every package may import it.
_BASE = {"shardings", "zoo", "data", "checkpoint", "runtime", "training", "errors"}
ALLOWED = {
    "errors": set(),
    "shardings": {"errors"},
    "zoo": {"shardings", "errors"},
    "data": {"runtime", "errors"},
    "checkpoint": {"zoo", "runtime", "errors"},
    "runtime": {"errors"},
    "training": {"zoo", "shardings", "data", "runtime", "errors"},
    "configs": {"training"},
    "launch": _BASE,
    "evaluation": {"launch"} | _BASE,
    "planning": {"launch"} | _BASE,
    "export": {"evaluation", "launch"} | _BASE,
    "serving": {"evaluation"} | _BASE,
}


def test_every_package_imports_only_what_the_architecture_allows():
    for module, deps in GRAPH.items():
        package = _package(module)
        bad = {d for d in deps if _package(d) not in ALLOWED[package] | {package}}
        assert not bad, f"{module} imports {sorted(bad)}; {package}/ may import {ALLOWED[package]}"


def test_configs_take_only_the_config_from_training():
    for module, deps in GRAPH.items():
        if _package(module) == "configs":
            bad = {
                d for d in deps if _package(d) == "training" and d != f"{NAMESPACE}.training.config"
            }
            assert not bad, f"{module} imports {sorted(bad)}"


def test_the_benches_import_no_test_module():
    # Fixtures both need live in bench/fixtures.py, which the tests import.
    for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "bench", name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            bad = [
                n
                for n in names
                if n == "tests" or n.startswith(("tests.", "_")) and n != "__future__"
            ]
            assert not bad, f"bench/{name} imports {bad}"


def test_no_package_imports_configs():
    # configs/ imports the run config's dataclasses (training); a package importing configs
    # back would close a circle through the top level (launch finds config files by path).
    for module, deps in GRAPH.items():
        if _package(module) != "configs":
            bad = {d for d in deps if _package(d) == "configs"}
            assert not bad, f"{module} imports {sorted(bad)}"
