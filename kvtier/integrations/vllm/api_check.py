"""``kvtier vllm-api``: does kvtier's connector fit a vLLM release? Read, never run.

Reads vLLM's sources from a wheel (``pip download --no-deps vllm==X``) or an
installed vLLM without importing either, and kvtier's connector from its own
source, and lists what would break:
- a hook kvtier relies on that the base class lacks (vLLM would never call it);
- a method kvtier overrides whose parameters differ from the base class's;
- an abstract method kvtier does not implement;
- a name kvtier imports from vLLM that the release no longer defines;
and, for review, the base class's methods that the tested release did not have,
and the connector methods that vLLM calls (outside its own connectors).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CONNECTORS = "vllm/distributed/kv_transfer/kv_connector/"  # other connectors' calls to each other are not vLLM's
# Hooks without which kvtier cannot work: its jobs report and release pins through them.
REQUIRED = ("build_connector_worker_meta", "update_connector_output", "get_handshake_metadata",
            "set_xfer_handshake_metadata", "handle_preemptions", "get_block_ids_with_load_errors",
            "has_pending_push_work", "request_finished", "get_finished")
KVTIER_SOURCES = ("connector.py", "compat.py", "scheduler_side.py", "requests.py", "worker_side.py", "metadata.py",
                  "metrics.py", "namespace.py")


class VllmSource:
    """The files of one vLLM release: a wheel, or the installed package's folder."""

    def __init__(self, where: str | None = None):
        if where and where.endswith(".whl"):
            self._wheel = zipfile.ZipFile(where)
            self._root = None
        else:
            self._wheel = None
            origin = Path(where) if where else Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
            self._root = origin.parent if origin.name == "vllm" else origin
        version = self.read("vllm/_version.py") or ""
        found = re.search(r"version = ['\"]([^'\"]+)['\"]|__version__ = version = ['\"]([^'\"]+)['\"]", version)
        self.version = next((g for g in found.groups() if g), "unknown") if found else "unknown"

    def python_files(self) -> list[str]:
        if self._wheel is not None:
            return [n for n in self._wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        return [str(p.relative_to(self._root)) for p in (self._root / "vllm").rglob("*.py")]

    def read(self, path: str) -> str | None:
        try:
            if self._wheel is not None:
                return self._wheel.read(path).decode()
            return (self._root / path).read_text()
        except (KeyError, FileNotFoundError):
            return None


@dataclass
class Method:
    parameters: tuple[str, ...]
    abstract: bool = False
    defaults_true: bool = False  # a body that is just ``return True``


@dataclass
class Report:
    version: str
    breaks: list[str] = field(default_factory=list)
    new_in_base: list[str] = field(default_factory=list)
    called: list[str] = field(default_factory=list)


def class_methods(source: str, name: str) -> dict[str, Method]:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = {}
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    arguments = item.args
                    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
                    names += [f"*{arguments.vararg.arg}"] if arguments.vararg else []
                    names += [f"**{arguments.kwarg.arg}"] if arguments.kwarg else []
                    decorators = {ast.unparse(d) for d in item.decorator_list}
                    body = [b for b in item.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
                    returns_true = (len(body) == 1 and isinstance(body[0], ast.Return)
                                    and isinstance(body[0].value, ast.Constant) and body[0].value.value is True)
                    methods[item.name] = Method(tuple(names), "abstractmethod" in decorators, returns_true)
            return methods
    return {}


def _top_level_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def kvtier_connector() -> tuple[dict[str, Method], list[tuple[str, str]]]:
    """kvtier's connector methods (its mixins' too), and every (module, name) it imports from vLLM."""
    here = Path(__file__).parent
    methods: dict[str, Method] = {}
    for cls, file in (("VllmCompat", "compat.py"), ("KVTierConnector", "connector.py")):
        methods.update(class_methods((here / file).read_text(), cls))
    imports = []
    for file in KVTIER_SOURCES:
        for node in ast.walk(ast.parse((here / file).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
                imports += [(node.module, alias.name) for alias in node.names]
    return methods, imports


def check(target: VllmSource, tested: VllmSource | None = None) -> Report:
    report = Report(target.version)
    base_source = target.read(BASE)
    if base_source is None:
        report.breaks.append(f"`{BASE}` is missing: no V1 connector API")
        return report
    base = class_methods(base_source, "KVConnectorBase_V1")
    ours, imports = kvtier_connector()
    for name in REQUIRED:
        if name not in base:
            report.breaks.append(f"`{name}` is not a connector hook any more: vLLM would never call kvtier's")
    for name, method in sorted(ours.items()):
        if name.startswith("_") or name not in base:
            continue
        if method.parameters != base[name].parameters:
            report.breaks.append(f"`{name}`: vLLM's takes ({', '.join(base[name].parameters)}), "
                                 f"kvtier's ({', '.join(method.parameters)})")
    for name, method in sorted(base.items()):
        if method.abstract and name not in ours:
            report.breaks.append(f"`{name}` is abstract and kvtier does not implement it")
    for module, name in imports:
        path = module.replace(".", "/")
        source = target.read(f"{path}.py") or target.read(f"{path}/__init__.py")
        if source is None:
            report.breaks.append(f"`{module}` is gone (kvtier imports `{name}` from it)")
        elif name not in _top_level_names(source):
            report.breaks.append(f"`{module}` no longer defines `{name}`")
    if tested is not None:
        tested_base = class_methods(tested.read(BASE) or "", "KVConnectorBase_V1")
        for name in sorted(set(base) - set(tested_base)):
            how = ("kvtier implements it" if name in ours else
                   "defaults to True: review" if base[name].defaults_true else "kvtier keeps vLLM's default")
            report.new_in_base.append(f"`{name}({', '.join(base[name].parameters)})`: {how}")
    called = set()
    for path in target.python_files():
        if not path.startswith(CONNECTORS):
            called |= set(re.findall(r"(?:connector|kv_transfer_group\(\))\.(\w+)\(", target.read(path) or ""))
    report.called = sorted(name for name in called if name in base)
    return report


def markdown(report: Report, tested_version: str | None) -> str:
    lines = [f"vLLM {report.version}, read statically" + (f" against {tested_version}:" if tested_version else ":")]
    lines += [f"- breaks: {b}" for b in report.breaks] or ["- breaks: none found"]
    lines += [f"- new hook: {n}" for n in report.new_in_base]
    lines.append(f"- hooks vLLM calls: {', '.join(f'`{c}`' for c in report.called)}")
    return "\n".join(lines)
