"""rudax's modules import one another in one direction only: no module imports, even for a
type annotation, a module that (through others) imports it back. A circle makes the import
order matter and the two modules one concept in two files (issue 40)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path, module: str) -> set[str]:
    """The rudax modules ``path`` (the module ``module``) imports, by their dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rudax")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rudax"):
            found.add(node.module)
            # `from rudax.models import _llama_hf_json`: a module imported by its name
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
    return {name for name in found if name != module}


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in (ROOT / "rudax").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    # a package's __init__ re-exports its modules: only the private modules' own imports count
    return {
        name: {m for m in _imports(path, name) if m in modules}
        for name, path in modules.items()
        if not path.name == "__init__.py"
    }


def test_no_module_of_rudax_imports_one_that_imports_it_back():
    graph = _graph()
    assert len(graph) > 100, len(graph)
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    circles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not circles, "\n".join(circles)
