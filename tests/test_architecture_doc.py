"""docs/ARCHITECTURE.md stays true to the tree: every path it names exists, and every module is named."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
PACKAGES = ("config", "kernels", "runtime", "service")


def test_every_path_the_architecture_names_exists():
    named = set(re.findall(r"`((?:bench|config|deploy|kernels|runtime|scripts|service|tests)/[\w./-]*)`", DOC))
    sources = set(re.findall(r"`csrc/([\w./-]+)`", DOC))
    assert len(named) > 50 and sources  # the pattern still reads the document
    assert sorted(n for n in named if not (ROOT / n).exists()) == []
    assert sorted(s for s in sources if not (ROOT / "kernels" / "csrc" / s).exists()) == []


def _is_named(module: Path) -> bool:
    """Named by its path, or by its file name in the row of its folder (`runtime/model/` ... `config.py`)."""
    path = module.relative_to(ROOT).as_posix()
    folder = module.parent.relative_to(ROOT).as_posix() + "/"
    return f"`{path}`" in DOC or any(line.startswith(f"| `{folder}`") and f"`{module.name}`" in line
                                     for line in DOC.splitlines())


def test_every_module_is_named_in_the_architecture():
    modules = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"]
    assert len(modules) > 80
    assert sorted(p.relative_to(ROOT).as_posix() for p in modules if not _is_named(p)) == []


def test_the_readme_is_short_and_every_relative_link_in_the_docs_resolves():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 300  # the rest lives in docs/, by topic
    pages = [readme, ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]
    links = [(page, target) for page in pages
             for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text())]
    assert len(links) > 10
    assert [(p.name, t) for p, t in links if not (p.parent / t).exists()] == []


def test_the_readme_and_api_examples_name_the_model_make_run_serves():
    """A request naming another model is a 404 (service/state.py: check_model)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from smollm2 import GGUF_NAME

    served = GGUF_NAME.removesuffix(".gguf")  # runtime/model/checkpoint.py names a GGUF by its file
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "api.md").read_text()
    examples = re.findall(r'"model": ?"([^"]+)"|model="([^"]+)"', text)
    assert len(examples) >= 7
    assert {a or b for a, b in examples} == {served}
