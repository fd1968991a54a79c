"""The layers of the code base, read from the source: imports flow one way, with no cycle anywhere.

Every import counts, wherever it stands (module level, inside a function, under TYPE_CHECKING): a lazy import that
dodges a cycle is still a cycle. LAYERS lists the layers bottom-up; a module may import its own layer and the layers
below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
PACKAGES = ("rollout", "trainer_hooks")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base: settings, validation, seeding", (
        "rollout.config", "rollout.sampling_params", "rollout.validation", "rollout.seeding", "rollout.lazy_exports",
        "rollout.thread_teams", "rollout.interpreter_exit", "rollout.openai_params", "rollout.loading")),
    ("engine.cpu: CPU facts, kernels, packed linears", ("rollout.engine.cpu",)),
    ("engine.sample: resolved settings, processors, the sampler", ("rollout.engine.sample",)),
    ("engine.core: requests, scheduler, blocks", ("rollout.engine.core",)),
    ("engine.worker: KV cache, attention, the model runner", ("rollout.engine.worker",)),
    ("engine: LLMEngine", ("rollout.engine",)),
    ("manager: the background loop and its entry points", ("rollout.output_router", "rollout.result_slots",
                                                          "rollout.submission", "rollout.manager",
                                                          "rollout.caller_stepping", "rollout.tp_loop",
                                                          "rollout.generate")),
    ("rl: generator, episodes, scoring, weights", ("rollout.rl",)),
    ("services: server, client, worker pools", ("rollout.server", "rollout.client", "rollout.distributed")),
    ("applications: trainers, the demo, the command line", ("trainer_hooks", "rollout.demo", "rollout.cli",
                                                           "rollout.__main__", "rollout.server.__main__")),
    ("facade: the package's public names", ("rollout",)),
]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts[:len(parts) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a package's own ancestors, which Python imports anyway, excluded)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported(node, module, path.name == "__init__.py"):
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    """The layer whose longest prefix names the module."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS in {__file__}"
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_the_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_never_reach_up_a_layer():
    found = upward_imports(import_graph())
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    graph = {"rollout.engine.core.a": {"rollout.engine.core.b"}, "rollout.engine.core.b": {"rollout.engine.core.a"},
             "rollout.engine.cpu.x": {"rollout.engine.worker.y"}, "rollout.engine.worker.y": set()}
    assert cycles(graph) == [["rollout.engine.core.a", "rollout.engine.core.b"]]
    assert upward_imports(graph) == ["rollout.engine.cpu.x (engine.cpu: CPU facts, kernels, packed linears) imports "
                                     "rollout.engine.worker.y (engine.worker: KV cache, attention, the model runner)"]
    lazy = ast.parse("def f():\n    from rollout.engine.core import scheduler\n")
    assert _imported(lazy.body[0].body[0], "rollout.x", False) == ["rollout.engine.core",
                                                                    "rollout.engine.core.scheduler"]
