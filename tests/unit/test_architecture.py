"""The layers and folders keep their rules (docs/architecture.md): no import circles anywhere, nothing imports
upward, `deployments/`'s parts import only what their docstrings allow, every module says what it is for,
and no module of `deployments/` outgrows one sitting.

Imports are read from the source (ast), at module level and inside functions alike; only those under
`if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "characters", "placement", "deployments")
GENERATED = ("deployments/api/proto/characters_pb2.py", "deployments/api/proto/characters_pb2_grpc.py")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "watch_page" in rel.parts:
                continue
            parts = rel.with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, typing: bool = False) -> list[tuple[str, bool]]:
    """(module imported, inside a function) for every import of `name`, resolved to the modules above
    (or to the top-level name of a third-party one); `typing`: those under `if TYPE_CHECKING:` too."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, bool]] = []

    def resolve(target: str) -> str:
        while target and target not in MODULES and "." in target:
            target = target.rpartition(".")[0]
        return target

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not typing and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                out.extend((resolve(a.name), inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - child.level + 1] + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in MODULES else resolve(base), inner))
            visit(child, inner)

    visit(tree, False)
    return [(m, f) for m, f in out if m and m != name]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
TYPED_GRAPH = {name: _imports(name, path, typing=True) for name, path in MODULES.items()}


def _cycles(graph: dict[str, list[tuple[str, bool]]] = GRAPH) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), i.e. import circles."""
    GRAPH = graph  # (the graph searched)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in GRAPH:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            connect(v)
    return found


def test_the_import_graph_is_read():
    """The reader sees what it must: a known module-level, a known lazy and a known TYPE_CHECKING import."""
    app = dict(GRAPH["deployments.api.app"])
    assert app["deployments.api.http"] is False
    assert app["deployments.sessions.scheduler"] is True  # inside connect_scheduler
    assert "deployments.livekit.config" not in dict(GRAPH["deployments.types"])  # TYPE_CHECKING only
    assert len(MODULES) > 80


def test_no_import_circles_anywhere():
    assert _cycles() == []


def test_no_import_circles_even_under_type_checking():
    """An import only type checkers run is still a circle of the design (characters.cpu <-> engine was one)."""
    assert "characters.engine" in dict(TYPED_GRAPH["characters.stages"])  # the reader sees TYPE_CHECKING imports
    assert _cycles(TYPED_GRAPH) == []


def test_the_cycle_finder_finds_a_circle():
    GRAPH["deployments.types"].append(("deployments.api.app", False))  # types -> api.app -> ... -> types
    try:
        assert any("deployments.types" in c and "deployments.api.app" in c for c in _cycles())
    finally:
        GRAPH["deployments.types"].pop()


LAYER = {"kernels": 0, "characters": 1, "placement": 2, "deployments": 3}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layers_never_import_upward(name):
    top = name.split(".")[0]
    up = [m for m, _ in GRAPH[name] if m.split(".")[0] in LAYER and LAYER[m.split(".")[0]] > LAYER[top]]
    assert up == [], f"{name} imports a higher layer: {up} (deployments -> placement -> characters -> kernels)"
    if top in ("kernels", "characters"):
        assert "ray" not in {m.split(".")[0] for m, _ in GRAPH[name]}, f"{name} imports Ray"
    if top == "placement":
        assert not {m for m, _ in GRAPH[name] if m.startswith(("ray.serve", "fastapi"))}, f"{name} imports Serve"


# What each part of deployments/ may import of deployments/ (its own modules always): the docstrings of the
# sub-packages say the same. cli may import anything; nothing may import cli.
SHARED = {"deployments.settings", "deployments.types"}
ALLOWED = {
    "types": set(),
    "settings": {"deployments.types"},
    "telemetry": SHARED,
    "livekit": SHARED | {"deployments.telemetry"},
    "pipeline": SHARED | {"deployments.telemetry", "deployments.livekit"},
    "store": SHARED,
    "sessions": SHARED | {"deployments.telemetry", "deployments.livekit", "deployments.pipeline", "deployments.store"},
    "api": SHARED | {"deployments.telemetry", "deployments.livekit.config", "deployments.store"},
    "app": {"deployments.api"},  # deployments.app and deployments.proto: aliases of one release
    "proto": {"deployments.api"},
}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("deployments.") and _part(m) != "cli"))
def test_each_part_of_deployments_imports_only_what_it_may(name):
    part = _part(name)
    allowed = ALLOWED[part]
    bad = []
    for target, lazy in GRAPH[name]:
        if not target.startswith("deployments.") or _part(target) == part:
            continue
        if name == "deployments.api.app" and target == "deployments.sessions.scheduler" and lazy:
            continue  # the scheduler actor's handle: the one way from a request to the session machinery
        if not any(target == a or target.startswith(a + ".") for a in allowed):
            bad.append(target)
    assert bad == [], f"{name} ({part}/) imports {bad}; it may import {sorted(allowed)} (docs/architecture.md)"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_says_what_it_is_for(name):
    path = MODULES[name]
    if str(path.relative_to(ROOT)) in GENERATED:
        return
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.split()) >= 4, f"{path.relative_to(ROOT)} has no docstring saying what it is for"


# deployments/ modules stay readable in one sitting; a longer one is named here with the reason.
LONGER = {"deployments/sessions/scheduler.py": "the actor's interface and how it applies decisions, in one place "
          "(admission, hand-outs, recovery, adoption); the slot lifecycle and the session records are out"}
MAX_LINES = 500


@pytest.mark.parametrize("path", sorted(p for p in MODULES.values() if p.is_relative_to(ROOT / "deployments")))
def test_modules_of_deployments_stay_small(path):
    rel = str(path.relative_to(ROOT))
    lines = len(path.read_text().splitlines())
    if rel in GENERATED:
        return
    limit = MAX_LINES * 1.2 if rel in LONGER else MAX_LINES
    assert lines <= limit, f"{rel} has {lines} lines (limit {limit:.0f}); split it by responsibility"


def test_the_names_manifests_use_still_resolve_for_one_release():
    """`deployments.app:build_app` and the gRPC servicer's old path (RayService manifests, `serve run`) are
    aliases of the moved objects, and importing the old app path says it is deprecated."""
    import importlib

    import deployments.api.app
    import deployments.api.proto.characters_pb2_grpc as grpc_new
    import deployments.app
    import deployments.proto.characters_pb2_grpc as grpc_old

    with pytest.deprecated_call(match="deployments.api.app"):
        old_app = importlib.reload(deployments.app)
    assert old_app.build_app is deployments.api.app.build_app
    assert grpc_old.add_CharactersServicer_to_server is grpc_new.add_CharactersServicer_to_server


def test_nothing_reads_outside_the_checkout():
    """A user's clone has nothing beside it: no test, script or module reaches for a sibling folder of the
    checkout (the read-only folder CI keeps beside its clone was one), and what the tests need, such as the
    KubeRay CRD schemas, is carried in the repository (k8s/crds/kuberay/)."""
    escapes = re.compile(r"""\.\./shared|\.parent\s*/\s*["']shared["']|parents\[\d+\]\s*/\s*["']shared["']|/work/""")
    found = []
    for folder in ("characters", "kernels", "placement", "deployments", "scripts", "tests", "k8s", "docker", ".ci"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".sh", ".toml", ".yaml", ".yml", ".cfg", "") and path.is_file() \
                    and "node_modules" not in path.parts and path != Path(__file__):
                text = path.read_text(errors="replace")
                found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in escapes.finditer(text)]
    assert found == []
    assert (ROOT / "k8s" / "crds" / "kuberay" / "ray.io_rayservices.yaml").is_file()
