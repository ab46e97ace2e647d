"""The import graph of replayssm_jax, read from its source files with `ast`.

- The reference holds math only: it imports, directly or through other
  modules, nothing of the package but itself and replayssm_jax.state (no
  argument checks, no dispatch, no kernels).
- The kernels likewise import nothing but themselves and the state: not
  the reference, not the ops.
- No module of the package imports itself through a chain of imports
  (imports inside functions count too).

An edge A -> B means that running module A runs module B first. `import
a.b.c` and `from a.b import c` also run the packages a and a.b, except the
packages that contain A, which run before A does (importing a submodule
from a package that is still running is fine; importing a name from it is
not, so that is an edge to the package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "replayssm_jax"


def module_files() -> dict[str, Path]:
    """{dotted module name: source file} for every module of the package."""
    files = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _packages(name: str) -> list[str]:
    """The packages that contain module `name`, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_imports(name: str, path: Path, modules) -> set[str]:
    """The modules of the package that running module `name` runs first."""
    is_package = path.name == "__init__.py"
    own_packages = set(_packages(name)) | ({name} if is_package else set())
    targets = set()

    def add(module: str, *, needs_body: bool) -> None:
        for package in _packages(module):
            if package not in own_packages:
                targets.add(package)
        if module in modules and (needs_body or module not in own_packages):
            targets.add(module)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, needs_body=False)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package
                base_parts = (name if is_package else name.rsplit(".", 1)[0]).split(".")
                base_parts = base_parts[:len(base_parts) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    add(submodule, needs_body=False)
                    add(base, needs_body=False)
                else:  # a name defined in `base`'s body
                    add(base, needs_body=True)
    targets.discard(name)
    return {t for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that running `start` runs, directly or not."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan),
    plus modules that import themselves."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_the_imports(graph):
    """The reading finds the imports that are there (so the checks below can fail)."""
    assert {f"{PACKAGE}.ops.validate", f"{PACKAGE}.ops.dispatch", f"{PACKAGE}.reference",
            f"{PACKAGE}.kernels", f"{PACKAGE}.state"} <= graph[f"{PACKAGE}.ops"]
    assert f"{PACKAGE}.state" in graph[f"{PACKAGE}.reference.mamba2"]
    assert f"{PACKAGE}.kernels.gdn" in graph[f"{PACKAGE}.kernels"]
    assert f"{PACKAGE}.ops" in graph[f"{PACKAGE}.layers.ssm_mixer"]
    assert f"{PACKAGE}.ops" in reachable(graph, f"{PACKAGE}.layers")


def test_the_cycle_finder_finds_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _reaches_only(graph, package: str, allowed: tuple[str, ...]) -> None:
    """Every module of `package` runs only modules of `package` and of `allowed`."""
    members = [name for name in graph if _inside(name, package)]
    assert members, f"no module {package}"
    for name in members:
        bad = sorted(m for m in reachable(graph, name) if not any(_inside(m, p) for p in (package, *allowed)))
        assert not bad, f"{name} imports {bad}"


def test_the_reference_holds_math_only(graph):
    """The reference reaches nothing but itself and the state pytrees: no
    argument checks, no dispatch, no kernels."""
    _reaches_only(graph, f"{PACKAGE}.reference", (f"{PACKAGE}.state",))


def test_the_kernels_do_not_import_the_reference_or_the_ops(graph):
    _reaches_only(graph, f"{PACKAGE}.kernels", (f"{PACKAGE}.state",))
    # and the state pytrees, which both use, import nothing of the package
    assert reachable(graph, f"{PACKAGE}.state") == set()


def test_no_import_cycle(graph):
    assert find_cycles(graph) == []


def test_layers_call_ops_as_functions():
    """No op is looked up by a name built at run time (getattr(ops, f"...")) in the layers."""
    for path in sorted((ROOT / PACKAGE / "layers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                target = node.args[0]
                assert not (isinstance(target, ast.Name) and target.id == "ops"), (
                    f"{path.name}:{node.lineno}: getattr(ops, ...)")
