"""The package's shape: no import circle, no oversized class, the core free of the engine and of
the benchmarks, the scheduler's half free of torch. Read from the source (``ast``) and from a
fresh interpreter's ``sys.modules``."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"
MAX_CLASS_LINES = 250
# The scheduler's half and the I/O process's: they run without torch and without any engine.
TORCH_FREE = ["kvtier.scheduler.manager", "kvtier.scheduler.completions", "kvtier.scheduler.lookups",
              "kvtier.scheduler.load_waves", "kvtier.scheduler.ledger", "kvtier.scheduler.hits", "kvtier.common.plans",
              "kvtier.scheduler.requests", "kvtier.scheduler.store_plans", "kvtier.scheduler.handoffs",
              "kvtier.scheduler.announcements",
              "kvtier.common.outcomes",
              "kvtier.common.keys", "kvtier.common.config", "kvtier.common.entry", "kvtier.tiers.namespaces",
              "kvtier.tiers.registry", "kvtier.tiers.host", "kvtier.tiers.disk", "kvtier.tiers.shared_dir",
              "kvtier.tiers.mooncake", "kvtier.tiers.redis", "kvtier.io.process", "kvtier.io.client"]


@functools.cache
def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


@functools.cache
def _imports(path: Path) -> frozenset[str]:
    """Every module ``path`` imports, at its top or inside a function (``TYPE_CHECKING`` blocks aside)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # imports for type checkers only: never run
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for after in sorted(graph[node]):
            if state.get(after) == 1:
                return path[path.index(after):] + [after]
            if after not in state and (found := visit(after, path)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back_even_from_inside_a_function():
    assert _cycle(_graph()) is None


def test_no_class_is_over_about_250_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long


def _importers_of(prefix: str) -> set[str]:
    return {name for name, path in _modules().items()
            if any(m == prefix or m.startswith(prefix + ".") for m in _imports(path))}


def test_only_the_engine_integration_and_the_engine_harness_import_vllm():
    assert {m for m in _importers_of("vllm") if not m.startswith(("kvtier.integrations.vllm", "kvtier.cli.demo"))} == set()


def test_the_product_imports_none_of_its_commands():
    """``kvtier.cli`` holds the commands (the demo and its engine harness, the benchmarks, the local
    pools, the proxy, the doctor): what runs inside an engine and the I/O process runs without them."""
    assert {m for m in _importers_of("kvtier.cli") if not m.startswith("kvtier.cli")} == set()


def test_the_worker_side_and_the_scheduler_side_import_nothing_of_each_other():
    """They meet in the plans (``kvtier.common.plans``) and the engine's adapter, never directly."""
    crossing = {(m, other) for side, other in (("kvtier.worker", "kvtier.scheduler"), ("kvtier.scheduler", "kvtier.worker"))
                for m in _importers_of(other) if m.startswith(side)}
    assert crossing == set()


def test_the_shared_types_import_no_side():
    """``kvtier.common`` is what every side builds on: it imports none of them, nor any tier (the
    configuration leaves a tier URL to its tier's module, asked when the tiers are built)."""
    sides = ("kvtier.scheduler", "kvtier.worker", "kvtier.io", "kvtier.transfer", "kvtier.integrations", "kvtier.cli",
             "kvtier.tiers")
    found = {(m, side) for side in sides for m in _importers_of(side) if m.startswith("kvtier.common")}
    assert found == set()


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_scheduler_and_io_halves_load_without_torch_or_an_engine(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "print(sorted(m for m in ('torch', 'vllm', 'kvtier.cli.bench', 'kvtier.cli.demo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# The commands that start or time tiers by kind (a local pool for the demo, a benchmark of each
# tier), and the shorthand's own vocabulary (``store_to``: disk, remote) in the configuration.
TIER_NAMES_ALLOWED_IN = ("kvtier.tiers", "kvtier.cli")


def test_no_tier_is_named_outside_its_own_module():
    """What a tier is (shared, its medium, its job size, how ``kvtier doctor`` asks it) is data it
    declares (``TierKind``): no code outside ``kvtier/tiers`` compares a tier's name or module."""
    from kvtier.tiers.registry import SCHEMES, kind_of

    names = {kind_of(f"{scheme}://x").name for scheme in SCHEMES} | set(SCHEMES.values())
    names -= {"disk"}  # also the shorthand's ``store_to`` word, checked below where it is not that
    found = []
    for module, path in _modules().items():
        if module.startswith(TIER_NAMES_ALLOWED_IN):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and (node.value in names or (
                    node.value == "disk" and module != "kvtier.common.config")):
                found.append(f"{module}:{node.lineno}: {node.value!r}")
    assert not found


def test_the_optional_features_wrap_the_worker_from_outside():
    """``verify_loads`` and ``save_only_first_rank`` subclass the load and store paths
    (``kvtier.worker.wrappers``): the paths and the worker read the same with both off."""
    words = {"verifier", "replicated", "is_source", "verify_loads", "save_only_first_rank", "LoadVerifier",
             "ReplicatedLoads", "broadcast"}
    found = []
    for module in ("kvtier.worker.loads", "kvtier.worker.stores", "kvtier.worker.tier_worker", "kvtier.worker.jobs"):
        for node in ast.walk(ast.parse(_modules()[module].read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else (
                node.arg if isinstance(node, ast.arg) else None)
            if name in words:
                found.append(f"{module}:{node.lineno}: {name}")
    assert not found
