"""The package builds cleanly: a wheel of the project, built as `scripts/setup.sh` builds it (setuptools from
PyPI in an isolated build environment), prints no warning (a `project.license` table once printed two
screens of deprecation notices on every setup)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_license_is_an_spdx_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_a_wheel_builds_without_a_warning(tmp_path):
    src = tmp_path / "src"  # a copy of what the build reads: the build's own files stay out of the checkout
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for pkg in ("characters", "deployments", "kernels", "placement"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("realtime_characters-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta


def _pins(specs: list[str]) -> dict[str, str]:
    """{normalised distribution name: pinned version} of `name==version` requirements (self-references skipped)."""
    out = {}
    for spec in specs:
        if "==" in spec:
            name, version = spec.split("==")
            out[name.lower().replace("_", "-")] = version
    return out


def _owners(module: str) -> set[str]:
    """The installed distributions that ship `module` (its `__init__.py` or its `.py`; none for a namespace)."""
    from importlib import metadata

    path = module.replace(".", "/")
    return {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()
            if any(str(f) in (f"{path}/__init__.py", f"{path}.py") for f in (d.files or ()))}


def _imported(tree: ast.Module) -> set[str]:
    """Modules an example imports at module level (a function's imports are its optional paths), a namespace
    package's subpackages by name (`from livekit import rtc`: livekit.rtc; `livekit` is shared by several
    distributions)."""
    out: set[str] = set()
    top = [n for stmt in tree.body for n in ([stmt, *stmt.body] if isinstance(stmt, ast.Try) else [stmt])]
    for node in top:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module != "__future__":
            subs = {f"{node.module}.{a.name}" for a in node.names}
            out |= {m for m in subs if _owners(m)} or {node.module}
    return {m for m in out if m.split(".")[0] not in sys.stdlib_module_names}


def test_the_agent_extra_has_what_the_voice_agent_example_imports():
    """`scripts/setup.sh --agent` installs the `agent` extra: with the base dependencies it must cover every
    third-party package examples/voice_agent.py imports, at the versions installed here (the ones the client
    tests ran it with). A user who set up without it got ModuleNotFoundError: livekit.agents."""
    from importlib import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "realtime-characters[agent]" in extras["dev"]  # the suite runs the example: --dev has it all
    base, agent = _pins(project["dependencies"]), _pins(extras["agent"])
    modules = _imported(ast.parse((ROOT / "examples" / "voice_agent.py").read_text()))
    assert {"livekit.rtc", "livekit.plugins.runway"} <= modules, modules
    assert any(m.startswith("livekit.agents") for m in modules), modules
    needed = set()
    for module in modules:
        owners = _owners(module)
        assert len(owners) == 1, f"{module}: shipped by {owners or 'nothing installed'}"
        needed |= owners
    missing = needed - base.keys() - agent.keys()
    assert not missing, f"examples/voice_agent.py imports {sorted(missing)}: in neither the dependencies nor `agent`"
    for name in needed & agent.keys():
        assert metadata.version(name) == agent[name], f"{name}: pinned {agent[name]}, {metadata.version(name)} here"


def test_the_voice_agent_example_says_how_to_install_what_it_misses():
    """Without LiveKit Agents the example exits with the command that installs it, not a traceback."""
    code = ("import runpy, sys; sys.modules['livekit.agents'] = None; "  # None: `import livekit.agents` fails
            f"runpy.run_path({str(ROOT / 'examples' / 'voice_agent.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "scripts/setup.sh --agent" in proc.stderr and "livekit.agents" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_setup_refuses_an_unknown_option_before_it_installs_anything(tmp_path):
    """A typo (`--agents`) stops at once with the options named, before a .venv is made or pip runs."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--agents"], capture_output=True, text=True,
                          timeout=30, cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown option '--agents'" in proc.stderr and "--agent, --dev" in proc.stderr
    assert "creating .venv" not in proc.stderr and "installing" not in proc.stderr
