"""Import layering of the package, read from the source (ast): the library core (layout, metadata,
validation, ops, backends, platforms, settings, builds) never imports the engine (model runner, KV-cache
groups, models, speculative decoding, CLIs, integrations), not even lazily inside a function; and
module-level imports between kvmulti's modules form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvmulti"
#: the engine and the applications on top of the library (modules and packages under kvmulti/)
ENGINE = ("kvmulti.engine", "kvmulti.kv_cache", "kvmulti.models", "kvmulti.spec_decode",
          "kvmulti.cli", "kvmulti.generate_cli", "kvmulti.integrations")
#: the facade: ``kvmulti/__init__.py`` names ModelRunner / SpeculativeRunner lazily for users
FACADE = "kvmulti"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module_level_only: bool) -> set[str]:
    """kvmulti modules ``path`` imports (relative imports resolved; ``from x import y`` counts as
    ``x.y`` when that is a module of the package, else ``x``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else base)
    return {m for m in found if m == "kvmulti" or m.startswith("kvmulti.")}


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _is_engine(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in ENGINE)


def test_the_library_never_imports_the_engine():
    offenders = {name: sorted(m for m in _imports(path, module_level_only=False) if _is_engine(m))
                 for name, path in _modules().items() if name != FACADE and not _is_engine(name)}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_module_level_imports_have_no_cycle():
    graph = {name: {m for m in _imports(path, module_level_only=True) if m in _modules() and m != name}
             for name, path in _modules().items()}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle
    graph = {name: {m for m in deps if not m.startswith(name + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_every_module_is_small():
    """Small modules with one job each: no Python file in the package over 400 lines."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def _library_names_used(path: Path) -> list[str]:
    """What a module of ``kvmulti/engine/`` takes from the library (not from the engine and the
    applications): ``from kvmulti import X`` gives ``kvmulti.X``; any other library import gives the
    module; ``obj._name`` on anything but ``self`` / ``cls`` gives ``._name``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    used = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            used += [a.name for a in node.names if a.name.startswith("kvmulti") and not _is_engine(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base == FACADE:
                used += [f"kvmulti.{a.name}" for a in node.names if not _is_engine(f"kvmulti.{a.name}")]
            elif base.startswith("kvmulti") and not _is_engine(base):
                used.append(base)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            used.append(f".{node.attr}")
    return used


def test_the_engine_uses_only_the_public_api():
    """kvmulti/engine/ is built on the library's public names (``kvmulti.__all__``: the ops,
    ``resolve_backend``, the layout and metadata types) and nothing private."""
    import kvmulti
    public = {f"kvmulti.{n}" for n in kvmulti.__all__}
    used = {p.name: _library_names_used(p) for p in (PACKAGE / "engine").rglob("*.py")}
    offenders = {k: sorted(set(v) - public) for k, v in used.items() if set(v) - public}
    assert not offenders, offenders
    assert {"kvmulti.prepare_steps", "kvmulti.resolve_backend"} <= set().union(*used.values())
