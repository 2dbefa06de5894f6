"""The package layout: no import circle, no import up the layers, every module tested.

A module's package says who runs it (``docs/architecture.md``). Imports go down the layers
only: the rank of the imported package must be below the importer's (or the same package);
the client and the server never import each other. Imports inside functions count too: a
lazy import is no way around a circle.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "car_fl"

#: Each package's layer; the top level (entry points) is above all.
RANKS = {
    "car_fl": 0,  # the package itself: its version, nothing imported
    "common": 0,
    "testing": 0,
    "privacy": 1,
    "heads": 1,
    "adapters": 2,
    "settings": 3,
    "data": 4,
    "results": 5,
    "blocks": 6,
    "model": 7,
    "training": 8,
    "serving": 8,
    "standalone": 9,
    "protocol": 9,
    "client": 10,
    "server": 10,
    "simulation": 11,
    "deploy": 11,
    "commands": 12,
    "": 13,
}
#: Packages of one layer that must not import each other.
APART = {frozenset({"client", "server"})}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The car_fl modules ``path`` imports, anywhere in it (submodules of ``from`` included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("car_fl"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("car_fl"):
            found.add(node.module)
            for alias in node.names:  # ``from car_fl.client import node_cache`` is a module
                if (
                    (PACKAGE.parent / (node.module + "." + alias.name).replace(".", "/"))
                    .with_suffix(".py")
                    .is_file()
                ):
                    found.add(f"{node.module}.{alias.name}")
    return {m for m in found if m != name}


GRAPH = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def package_of(module: str) -> str:
    """``client`` for ``car_fl.client.round``; ``""`` for an entry point (``car_fl.cli``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "car_fl"
    return parts[1] if len(parts) > 2 or parts[1] in RANKS else ""


def test_the_graph_sees_the_packages() -> None:
    assert (
        "car_fl.client.round" in GRAPH and "car_fl.model.retriever" in GRAPH["car_fl.client.round"]
    )
    assert {package_of(m) for m in GRAPH} == set(RANKS)


def test_no_import_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH.get(node, ()):
            if nxt not in GRAPH:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert circles == []


def test_imports_go_down_the_layers_only() -> None:
    upward = defaultdict(list)
    for module, targets in GRAPH.items():
        mine = package_of(module)
        for target in targets:
            theirs = package_of(target)
            if theirs == mine:
                continue
            if RANKS[theirs] >= RANKS[mine] or frozenset({mine, theirs}) in APART:
                upward[module].append(target)
    assert dict(upward) == {}


def test_a_package_init_imports_nothing() -> None:
    """Importing one module never loads its siblings (a cached client round stays light)."""
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert not [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)], init
        assert ast.get_docstring(tree), f"{init} names its public parts in a docstring"


def test_the_app_modules_load_no_torch_hydra_or_tqdm() -> None:
    """Flower imports both apps in every process it starts: what they need loads when used."""
    code = (
        "import sys; sys.path.insert(0, '.'); import server_app, client_app; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hydra', 'tqdm'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "path", sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"), ids=str
)
def test_every_module_has_its_tests(path: Path) -> None:
    """``tests/<package>/test_<module>.py``, or a line in ``tests/<package>/__init__.py``."""
    package = package_of(module_name(path))
    folder = ROOT / "tests" / package if package else ROOT / "tests"
    if (folder / f"test_{path.stem}.py").is_file():
        return
    elsewhere = importlib.import_module(".".join(["tests", package]).rstrip(".")).TESTED_ELSEWHERE
    assert path.stem in elsewhere, f"no test file for {path} and no TESTED_ELSEWHERE line"
    file, _, test = elsewhere[path.stem].partition("::")
    source = (ROOT / file).read_text(encoding="utf-8")
    assert f"def {test}(" in source, f"{elsewhere[path.stem]} does not exist"


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def package_picture() -> str:
    """The packages' import graph (transitive reduction) as a Mermaid flowchart, top down."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        for target in targets:
            mine, theirs = package_of(module) or "entry points", package_of(target)
            if theirs not in (package_of(module), "car_fl"):
                edges[mine].add(theirs or "entry points")

    def reachable(start: str, skip: tuple[str, str]) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for nxt in edges.get(node, ()):
                if (node, nxt) != skip and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    kept = sorted(
        (a, b) for a, targets in edges.items() for b in targets if b not in reachable(a, (a, b))
    )
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {a.replace(' ', '_')}[{a}] --> {b}" for a, b in kept]
    return "\n".join([*lines, "```"])


def test_the_architecture_picture_is_drawn_from_the_code() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    drawn = text.split("<!-- packages:begin -->\n")[1].split("<!-- packages:end -->")[0].strip()
    assert drawn == package_picture(), "docs/architecture.md: replace the picture with\n" + (
        package_picture()
    )


def test_the_round_in_the_architecture_names_real_functions() -> None:
    """Every dotted name the round's path gives exists (the page cannot go stale)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    path = text.split("<!-- round:begin -->")[1].split("<!-- round:end -->")[0]
    named = set(re.findall(r"`((?:car_fl|server_app|client_app)\.[\w.]+)`", path))
    assert len(named) >= 10
    for dotted in sorted(named):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix is the module
            try:
                obj: object = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attribute in parts[cut:]:
                assert hasattr(obj, attribute), f"{dotted} named in {ARCHITECTURE} does not exist"
                obj = getattr(obj, attribute)
            break
        else:
            raise AssertionError(f"{dotted} named in {ARCHITECTURE}: no such module")


def package_modules() -> dict[str, list[str]]:
    """Every package of car_fl and the modules in it (by file stem)."""
    return {
        init.parent.name: sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        for init in sorted(PACKAGE.glob("*/__init__.py"))
    }


def test_every_module_is_in_its_packages_list() -> None:
    """A package's ``__init__`` docstring lists every module in it (issue 42: 26 were missing)."""
    missing = []
    for package, modules in package_modules().items():
        text = (PACKAGE / package / "__init__.py").read_text(encoding="utf-8")
        missing += [
            f"car_fl.{package}.{m}" for m in modules if f"car_fl.{package}.{m}`" not in text
        ]
    assert missing == [], "add a line for each to its package's __init__ docstring"


def test_the_architecture_names_every_module() -> None:
    """docs/architecture.md's table of packages names every module of each, in backticks."""
    rows = {
        line.split("`", 2)[1]: line
        for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `car_fl/")
    }
    missing = []
    for package, modules in package_modules().items():
        row = next((r for key, r in rows.items() if f"car_fl/{package}/" in r.split("|")[1]), "")
        missing += [
            f"{package}.{m}" for m in modules if f"`{m}`" not in row and f"`{m}." not in row
        ]
    assert missing == [], "name each in its package's row of docs/architecture.md"


DOC_REFERENCE = re.compile(
    r"docs/(\w+)\.md(?:#([\w-]+)|,\s+(?:\"([^\"]+)\"|'((?:[^']|'(?=s\b))+)'))?"
)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_doc_section_the_code_points_to_exists() -> None:
    """A docstring that says "see docs/x.md, 'Section'" (or ``docs/x.md#anchor``) in place of
    an argument names a file, and a heading or bold lead-in in it, that exist."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, anchor, double, single in DOC_REFERENCE.findall(path.read_text("utf-8")):
            section = double or single
            doc = ROOT / "docs" / f"{name}.md"
            assert doc.is_file(), f"{path.relative_to(ROOT)} points to {doc.name}, missing"
            text = doc.read_text(encoding="utf-8")
            headings = [line.lstrip("#").strip() for line in text.splitlines() if line[:1] == "#"]
            if anchor:
                assert anchor in {_slug(h) for h in headings}, (path.name, name, anchor)
            if section:
                lead = section.rstrip(".")
                bold = re.search(rf"\*\*[^*]{{0,8}}{re.escape(lead)}", text)
                named = any(lead in h for h in headings) or bold is not None
                assert named, f"{path.relative_to(ROOT)}: no '{section}' in docs/{name}.md"
            found.append((name, anchor or section))
    assert len(found) > 10  # the references exist: the pattern still matches them
