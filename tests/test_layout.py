"""The arrows of the README's "Design": which packages may import which."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["accounts", "fleet", "tuning", "costs", "jobs", "checkpoints"]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(folder: str):
    return [p for p in (ROOT / folder).rglob("*.py") if "migrations" not in p.parts]


@pytest.mark.parametrize("path", python_files("apps"), ids=lambda p: str(p.relative_to(ROOT)))
def test_apps_import_only_apps_below_them_and_never_workers(path):
    app = path.relative_to(ROOT / "apps").parts[0]
    if app not in LAYERS:
        return
    allowed_below = set(LAYERS[: LAYERS.index(app) + 1])
    for name in imports_of(path):
        if name.startswith("workers"):
            assert name.startswith("workers.trainer.presets"), f"{path} imports {name}"
        if name.startswith("apps."):
            other = name.split(".")[1]
            assert other in allowed_below, f"{path} (in {app}) imports the higher app {other}"


@pytest.mark.parametrize(
    "path", python_files("workers/agent"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_agent_uses_the_standard_library_only(path):
    for name in imports_of(path):
        top = name.split(".")[0]
        assert top in sys.stdlib_module_names or top == "workers", f"{path} imports {name}"


@pytest.mark.parametrize(
    "path",
    python_files("workers/providers")
    + python_files("workers/trainer")
    + python_files("workers/agent"),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_providers_agent_and_trainer_do_not_import_django(path):
    for name in imports_of(path):
        assert not name.startswith(("django", "rest_framework", "apps")), f"{path}: {name}"
