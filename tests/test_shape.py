"""The package keeps the shape limits of the project's standards: no function over 80 lines,
no class over 500, no module under ``chaos_flwr/flower`` over 700, and no import cycle among
the modules' top-level imports (imports under ``TYPE_CHECKING`` excluded)."""

from __future__ import annotations

import ast
from pathlib import Path

import chaos_flwr

PKG = Path(chaos_flwr.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 500
MAX_FLOWER_MODULE_LINES = 700


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return out


def _span(node: ast.AST) -> int:
    end = getattr(node, "end_lineno", None)
    return 0 if end is None else end - getattr(node, "lineno", end) + 1


def test_no_function_or_class_over_its_limit() -> None:
    over = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _span(node) > MAX_FUNCTION_LINES:
                    over.append(f"{name}.{node.name}: {_span(node)} lines")
            elif isinstance(node, ast.ClassDef) and _span(node) > MAX_CLASS_LINES:
                over.append(f"class {name}.{node.name}: {_span(node)} lines")
    assert over == []


def test_no_flower_module_over_its_limit() -> None:
    over = [
        f"{p.relative_to(PKG)}: {n} lines"
        for p in sorted((PKG / "flower").rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FLOWER_MODULE_LINES
    ]
    assert over == []


def _top_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports when it is imported."""
    out: set[str] = set()
    is_pkg = any(k.startswith(name + ".") for k in known)
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                break
            if isinstance(sub, ast.Import):
                out |= {a.name for a in sub.names if a.name in known}
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    parts = parts[: len(parts) - sub.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for a in sub.names:
                    full = f"{base}.{a.name}"
                    out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def test_no_import_cycle() -> None:
    mods = _modules()
    known = set(mods)
    graph = {n: _top_imports(n, t, known) for n, t in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle through them
    for n in graph:
        graph[n] = {m for m in graph[n] if not (m.startswith(n + ".") or n.startswith(m + "."))}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append([*stack[stack.index(m) :], m])
            elif m not in state:
                visit(m, [*stack, m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []
