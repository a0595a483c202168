"""The arrows of the README's "Design": which packages may import which."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["accounts", "outbox", "fleet", "tuning", "costs", "jobs", "checkpoints"]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


# The trainer's modules the control plane may import: plain data and arithmetic, no torch.
TORCH_FREE_TRAINER = ("workers.trainer.presets", "workers.trainer.config", "workers.trainer.memory")


@pytest.mark.parametrize("module", TORCH_FREE_TRAINER)
def test_the_trainer_modules_the_control_plane_imports_need_no_torch(module):
    path = ROOT / (module.replace(".", "/") + ".py")
    for name in imports_of(path):
        assert not name.startswith("torch"), f"{module} imports {name}"
        if name.startswith("workers"):
            assert name in TORCH_FREE_TRAINER, f"{module} imports {name}"


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
            assert name in TORCH_FREE_TRAINER, f"{path} imports {name}"
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


@pytest.mark.parametrize("path", python_files("cpctl"), ids=lambda p: str(p.relative_to(ROOT)))
def test_cpctl_uses_the_standard_library_only(path):
    for name in imports_of(path):
        top = name.split(".")[0]
        # PyYAML is read only for a .yaml spec, and imported only then.
        allowed = top in sys.stdlib_module_names or top in ("cpctl", "yaml")
        assert allowed, f"{path} imports {name}"


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


# --- import cycles ---------------------------------------------------------------------

# Cycles that must stay, each with why. (Imports under `if TYPE_CHECKING:` never run and do
# not count.)
CYCLES_ALLOWED: dict[frozenset[str], str] = {}


def project_modules() -> dict[str, Path]:
    modules = {}
    for top in ("apps", "controlplane", "workers", "cpctl"):
        for path in python_files(top):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _run_time_nodes(tree: ast.AST):
    """Every node of the tree but what sits under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in [child, *_run_time_nodes(child)])
            continue
        yield node
        yield from _run_time_nodes(node)


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, at the top or inside functions alike."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _run_time_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found.update(known(f"{base}.{alias.name}") for alias in node.names)
    return found - {None, name}


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected parts of the import graph with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            part = []
            while (top := stack.pop()) != module:
                part.append(top)
            if part:
                cycles.append(frozenset([module, *part]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles_among_the_projects_modules():
    modules = project_modules()
    graph = {name: module_imports(name, path, modules) for name, path in modules.items()}
    cycles = [sorted(c) for c in import_cycles(graph) if c not in CYCLES_ALLOWED]
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_loop_of_three():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [frozenset("abc")]


# --- an app reads another's rows through that app's selectors and services -----------------

# Modules that import another app's model classes, each with why. (Choices, constants and
# validators from another app's models are not rows and do not count; nor do the models'
# own foreign keys.)
MODEL_IMPORTS_ALLOWED: dict[str, str] = {
    "apps/fleet/management/commands/demo_fleet.py": "the demo seeds teams and users itself",
    "apps/jobs/management/commands/demo_training.py": "the demo's job is its demo team's",
    "apps/jobs/api/serializers.py": "a reservation's nodes are a DRF related field",
    "apps/jobs/forms.py": "the Submit form's team is a model choice field",
    "apps/jobs/scheduler/apply.py": "the pass locks the nodes it places on with its writes",
    "apps/jobs/scheduler/read.py": "the pass reads the whole fleet in a few raw queries",
}

# Tasks call apps' services and selectors; these still read rows themselves.
MODELS = ("models", "models.py")


def foreign_model_imports(path: Path) -> list[str]:
    """`module.Name` for each model class this module imports, at run time, from another
    app's models (from any app's, outside apps/)."""
    from django.db import models

    where = path.relative_to(ROOT).parts
    app = where[1] if where[0] == "apps" else None
    found = []
    for node in _run_time_nodes(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
            continue
        parts = node.module.split(".")
        if parts[0] != "apps" or parts[1] == app or parts[2:3] != ["models"]:
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            value = getattr(module, alias.name, None)
            if isinstance(value, type) and issubclass(value, models.Model):
                found.append(f"{node.module}.{alias.name}")
    return found


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in python_files("apps")
        if not set(p.relative_to(ROOT / "apps").parts[1:2]) & set(MODELS)
    ]
    + python_files("workers/tasks"),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_an_app_reads_another_apps_rows_through_its_selectors(path):
    relative = str(path.relative_to(ROOT))
    found = foreign_model_imports(path)
    if relative in MODEL_IMPORTS_ALLOWED:
        assert found, f"{relative} is allowed what it no longer does"
        return
    assert not found, f"{relative} imports {found}: read them through the owning app's selectors"
