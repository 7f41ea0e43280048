"""service/'s parts and the imports between them: one way, no cycles (docs/ARCHITECTURE.md).

A part is a flat module (service/streams.py -> "streams") or a folder (service/api/ -> "api").
"""

import ast
from collections import defaultdict
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"
FOLDERS = ("api", "billing", "bridge", "distributed")


def _part(module: str) -> str | None:
    names = module.split(".")
    return names[1] if names[0] == "service" and len(names) > 1 else None


def import_graph() -> dict[str, set[str]]:
    """part -> the other parts it imports (from any of its modules, at any depth)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in SERVICE.rglob("*.py"):
        source = _part(".".join(path.relative_to(SERVICE.parent).with_suffix("").parts))
        edges.setdefault(source, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in filter(None, map(_part, targets)):
                if target != source:
                    edges[source].add(target)
    edges.pop("__init__", None)
    return edges


def test_the_parts_are_the_folders_and_flat_modules():
    parts = set(import_graph())
    assert {"api", "billing", "app", "bridge", "state", "errors"} <= parts
    flat = {p.stem for p in SERVICE.glob("*.py") if p.stem != "__init__"}
    assert parts == flat | set(FOLDERS)


def test_only_the_app_imports_the_api():
    importers = {source for source, targets in import_graph().items() if "api" in targets}
    assert importers == {"app"}


def test_only_the_app_and_the_cli_import_the_distributed_part_and_it_never_imports_the_api():
    importers = {source for source, targets in import_graph().items() if "distributed" in targets}
    assert importers == {"app", "cli"}  # the front door's bridge; `pagedserve worker`
    assert "api" not in import_graph()["distributed"] and "app" not in import_graph()["distributed"]


def test_billing_imports_no_other_part():
    assert import_graph()["billing"] == set()


def test_the_import_graph_has_no_cycles():
    edges = import_graph()
    visiting, done = set(), set()

    def visit(part: str, path: list[str]) -> None:
        if part in done:
            return
        if part in visiting:
            raise AssertionError(f"import cycle: {' -> '.join([*path, part])}")
        visiting.add(part)
        for target in sorted(edges.get(part, ())):
            visit(target, [*path, part])
        visiting.discard(part)
        done.add(part)

    for part in sorted(edges):
        visit(part, [])
