"""engine/'s imports, read from the source with ast (nothing is imported): no module imports itself through
others, and none imports a layer above its own. Imports inside functions count, as they are dependencies all
the same; those under `if TYPE_CHECKING:` do not, as only type checkers run them.

A unit is a subpackage of engine/ (engine/guided/) or one of its top-level modules (engine/scheduler.py).
LAYERS orders the units from the ground up. A unit may import its own modules and those of the layers below it;
units that share a layer are independent, and may not import each other."""
import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "engine"

LAYERS = [   # (units, why they stand here)
    (("config", "timings", "parallel", "memory"), "settings, counters, collectives, KV pages: nothing of the engine"),
    (("kernels", "attention"), "compute on plain tensors: Triton kernels, their torch twins and the route table; "
                               "a paged step's metadata and the reference attention"),
    (("backend",), "which kernel runs each op of the model: kernels and the reference"),
    (("models",), "the forward, over the backend it is handed"),
    (("sampling",), "logits to tokens, and what a request may ask of them"),
    (("guided",), "grammars and their masks, which the sampler applies"),
    (("requests", "speculative"), "a request's host state; drafting and verification on the device"),
    (("runner", "scheduler"), "one step on the device; which rows the next step runs"),
    (("commit", "workers"), "what a step's tokens do to their requests; the other ranks of tensor parallelism"),
    (("llm_engine", "options"), "the loop that joins them; the command line's options for it"),
    (("server",), "the HTTP processes around one engine"),
    (("cli",), "the console script: every way in"),
]
LAYER = {unit: i for i, (units, _) in enumerate(LAYERS) for unit in units}


def modules(root: Path = ENGINE) -> dict[str, Path]:
    """{dotted name: file} of every module under root (a package by its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("engine",) + path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str, path: Path) -> list[tuple[str, int, list[str]]]:
    """(module named, line, names taken from it) for each import in the file, nested ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, []) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - child.level + 1] if child.level else []
                module = ".".join(base + ([child.module] if child.module else []))
                found.append((module, child.lineno, [alias.name for alias in child.names]))
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return found


def import_graph(mods: dict[str, Path]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """({module: {engine module it imports: line}}, imports of engine modules that do not exist)."""
    graph, missing = {name: {} for name in mods}, []
    for name, path in mods.items():
        for module, line, names in imports(name, path):
            if module != "engine" and not module.startswith("engine."):
                continue
            if module not in mods:
                missing.append(f"{path.relative_to(ENGINE.parent)}:{line} imports {module}")
                continue
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in mods] or [module]:
                if target != name:
                    graph[name].setdefault(target, line)
    return graph, missing


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    return next((cycle for node in sorted(graph) if node not in state and (cycle := visit(node))), None)


def unit(name: str) -> str | None:
    """The unit a module belongs to (None for engine/__init__.py)."""
    return name.split(".")[1] if name.count(".") else None


@pytest.fixture(scope="module")
def graph_and_missing():
    return import_graph(modules())


@pytest.fixture(scope="module")
def graph(graph_and_missing):
    return graph_and_missing[0]


def test_every_engine_import_names_a_module(graph_and_missing):
    """A module renamed or removed, and an import of it left behind (one inside a function fails only when run)."""
    assert not graph_and_missing[1]


def test_no_import_circles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_every_unit_has_a_layer(graph):
    assert not {unit(m) for m in graph} - set(LAYER) - {None}, "place the new unit in LAYERS"


def test_no_module_imports_a_layer_above_it(graph):
    wrong = []
    for name, targets in graph.items():
        for target, line in targets.items():
            here, there = unit(name), unit(target)
            if here and there and here != there and LAYER[there] >= LAYER[here]:
                low, high = LAYER[here], LAYER[there]
                why = "its own layer" if high == low else f"layer {high}, above its {low}"
                wrong.append(f"{name}:{line} imports {target} ({why}: {LAYERS[high][1]})")
    assert not wrong, "\n".join(wrong)


def test_a_circle_is_named_with_its_lines():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7, "d": 1}, "d": {}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None
