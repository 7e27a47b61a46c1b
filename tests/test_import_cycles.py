"""No import cycles inside ember_cupy, between modules or between its top-level parts (engine,
model, server, ops, tokenizer, ...). Imports inside functions count too: a lazy import only
hides a cycle."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ember_cupy"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the ember_cupy modules it imports (`from pkg import mod` names mod, not pkg)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            targets |= {resolve(n) for n in names if n.split(".")[0] == "ember_cupy"}
        graph[module] = targets - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def _top_level(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_cycle_between_top_level_parts():
    parts: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        parts.setdefault(_top_level(module), set()).update(
            _top_level(t) for t in targets if _top_level(t) != _top_level(module))
    assert cycles(parts) == []


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# What the HTTP layer may import of the rest of the package: the engine-client contract and the data
# types a request is made of. async_engine (the in-process EngineClient) is the one server module that
# holds an LLMEngine, and ember_cupy.info describes the process for /version before an engine is up.
SERVER_MAY_IMPORT = ("ember_cupy.server", "ember_cupy.engine_client", "ember_cupy.sampling_params",
                     "ember_cupy.outputs", "ember_cupy.engine.pooling", "ember_cupy.structured",
                     "ember_cupy.tool_calls", "ember_cupy.tool_parsers", "ember_cupy.reasoning",
                     "ember_cupy.chat_template", "ember_cupy.error_text", "ember_cupy.info")
ENGINE_CLIENT_IMPLEMENTATIONS = {"ember_cupy.server.async_engine"}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_server_talks_to_an_engine_only_through_the_client_contract():
    graph = import_graph()
    crossing = {module: sorted(t for t in targets if t != "ember_cupy" and not _within(t, SERVER_MAY_IMPORT))
                for module, targets in graph.items()
                if _within(module, ["ember_cupy.server"]) and module not in ENGINE_CLIENT_IMPLEMENTATIONS}
    assert {m: t for m, t in crossing.items() if t} == {}
