"""The layering docs/architecture.md promises, checked on the source tree: no import cycle in the
package (imports inside functions included), torch.ops.fp8amp called only from the op layer, no
source file over 500 lines, and no citation of a document outside the repository."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "fp8amp"


def modules():
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def imported(name: str, path: pathlib.Path, known: set) -> set:
    """The package modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # `from pkg import module` imports the module (pkg is its parent)
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def test_no_import_cycle():
    mods = modules()
    graph = {name: imported(name, path, set(mods)) for name, path in mods.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_only_the_op_layer_calls_torch_ops_fp8amp():
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if "ops" not in p.relative_to(PACKAGE).parts[:1] and "torch.ops.fp8amp" in _code(p)]
    assert not offenders, f"torch.ops.fp8amp outside python/fp8amp/ops: {offenders}"


def _code(path: pathlib.Path) -> str:
    """The file without comments and docstrings (which may name the namespace)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


SOURCE_DIRS = ("python/fp8amp", "src", "include", "bindings")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".cuh"}


def test_no_source_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for d in SOURCE_DIRS for p in (ROOT / d).rglob("*")
            if p.suffix in SOURCE_SUFFIXES and (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split by concern: {long}"


def test_no_citation_of_a_document_outside_the_repository():
    pattern = re.compile(r"DESIGN §")
    cited = [str(p.relative_to(ROOT)) for d in ("python", "src", "include", "bindings", "tests", "docs",
                                                 "benchmarks", "examples", "scripts")
             for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES | {".md", ".sh", ".txt"}
             and p.name != "test_structure.py" and pattern.search(p.read_text(errors="ignore"))]
    if pattern.search((ROOT / "README.md").read_text()):
        cited.append("README.md")
    assert not cited, f"cite docs/ of this repository instead: {cited}"
