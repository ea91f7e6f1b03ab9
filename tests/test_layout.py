"""The package's shape, checked on its source with ``ast`` (nothing is imported): only the
integration layer and the lab touch Megatron or patch anything, kernels know no
torch.distributed, no module state behind ``global``, no flag spelled below the config layer,
functions small enough to read, no import circle, every import down or along a floor
(docs/architecture.md), the plugin apart from its lab."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_overlap"
ALLOWED_TO_TOUCH_MEGATRON = ("integration", "lab")
BELOW_CONFIG = ("integration", "tp", "cp", "hdp", "pp", "comm", "kernels", "tune", "trace")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        yield rel, ast.parse(path.read_text(), filename=str(path))


def _area(rel: pathlib.Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _imported_modules(tree):
    """(module name, line) of every import, at any depth (function-level imports included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def test_the_walk_sees_every_module():
    names = {str(rel) for rel, _ in _modules()}
    assert {"integration/install.py", "tp/linear.py", "cp/ring.py", "hdp/runtime.py", "kernels/ag_gemm.py",
            "lab/emulated_link.py", "config.py"} <= names
    # and the rule below would catch a stray import
    assert any(_is_megatron(m) for m, _ in _imported_modules(ast.parse("def f():\n    import megatron.core\n")))


def test_only_the_integration_layer_and_the_lab_import_megatron():
    offenders = [f"{rel}:{line} imports {name}" for rel, tree in _modules()
                 if _area(rel) not in ALLOWED_TO_TOUCH_MEGATRON
                 for name, line in _imported_modules(tree) if _is_megatron(name)]
    assert not offenders, "\n".join(offenders)


def _imported_names(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


def _root(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _patches(tree):
    """Assignments to an attribute of an imported module or object (``torch.cuda.x = ...``,
    ``setattr(module, ...)``): monkey-patching."""
    imported = _imported_names(tree)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and _root(t) in imported:
                    yield node.lineno, ast.unparse(t)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and _root(node.args[0]) in imported):
            yield node.lineno, ast.unparse(node)


def test_nothing_outside_integration_and_the_lab_monkey_patches():
    offenders = [f"{rel}:{line} assigns {what}" for rel, tree in _modules()
                 if _area(rel) not in ALLOWED_TO_TOUCH_MEGATRON for line, what in _patches(tree)]
    assert not offenders, "\n".join(offenders)
    # the rule catches the forms it is for
    caught = list(_patches(ast.parse("import torch\nfrom megatron import x\ntorch.cuda.current_device = f\n"
                                     "setattr(x, 'y', 1)\nx.y.z += 1\n")))
    assert sorted(line for line, _ in caught) == [3, 4, 5]


def test_kernels_know_no_torch_distributed():
    offenders = [f"{rel}:{line} imports {name}" for rel, tree in _modules() if _area(rel) == "kernels"
                 for name, line in _imported_modules(tree)
                 if name == "torch.distributed" or name.startswith("torch.distributed.")]
    assert not offenders, "\n".join(offenders)


def test_no_global_statement_outside_the_lab():
    offenders = [f"{rel}:{node.lineno}" for rel, tree in _modules() if _area(rel) != "lab"
                 for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert not offenders, offenders


def _docstrings(tree) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_no_flag_is_spelled_below_the_config_layer():
    """Errors and notices there name config fields (``tp.chunks``); errors.render and the one
    map in args.py turn them into flags. Docstrings may mention flags."""
    from megatron_overlap.args import FLAGS

    offenders = []
    for rel, tree in _modules():
        if _area(rel) not in BELOW_CONFIG:
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if any(flag in node.value for flag in FLAGS):
                    offenders.append(f"{rel}:{node.lineno}: {node.value[:60]!r}")
    assert not offenders, "\n".join(offenders)


def test_functions_are_small_enough_to_read():
    """A file may be long when it holds one responsibility (the circles below say when it does
    not); a function of more than 80 lines holds several."""
    long_fns = [f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}" for rel, tree in _modules()
                for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > 80]
    assert not long_fns, long_fns


# -- the import graph ------------------------------------------------------------------------
def _module_name(rel: pathlib.Path) -> str:
    parts = ("megatron_overlap",) + rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict:
    """Module -> the package's modules it imports, function-level imports counted as module-level
    ones (a lazy import still ties the two files). An edge goes to the module a name comes from:
    ``from .cp import ring`` to ``cp.ring``, ``from .cp import CP_MODES`` to ``cp`` (its
    ``__init__``); the parent packages Python also runs on the way are not edges."""
    trees = {_module_name(rel): (rel, tree) for rel, tree in _modules()}

    def resolve(name):
        while name and name not in trees:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, (rel, tree) in trees.items():
        package = module if rel.name == "__init__.py" else module.rpartition(".")[0]
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(resolve(a.name) for a in node.names if a.name.startswith("megatron_overlap"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                if base.startswith("megatron_overlap"):
                    out.update(resolve(f"{base}.{a.name}") for a in node.names)
        graph[module] = out - {None, module}
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# A circle left for its owner: cli/bench_hdp.py dispatches --sweep to bench_hdp_sweep.py, which
# reads bench_hdp's runner back (the lab's files; moving the dispatch is more than an import).
KNOWN_CIRCLES = []


def test_no_import_circle_larger_than_one_file():
    circles = _circles(_graph())
    assert [c for c in circles if c not in KNOWN_CIRCLES] == [], circles
    assert all(c in circles for c in KNOWN_CIRCLES), "a known circle is gone: drop it from KNOWN_CIRCLES"


def test_the_circle_walk_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]
    # relative, lazy and package imports all make edges
    got = _graph()
    assert "megatron_overlap.errors" in got["megatron_overlap.args"]  # from .errors import ...
    assert "megatron_overlap.cp" in got["megatron_overlap.args"]  # from .cp import CP_MODES (the __init__)
    assert "megatron_overlap.tp.backends.symm_mem" in got["megatron_overlap.tp.backends"]  # from . import symm_mem, lazily


# Floors, lowest first (docs/architecture.md): a module imports only from its own floor or the
# floors below. The longest prefix names a module's floor.
FLOORS = (
    ("leaves", ("errors", "flag_names", "version", "rules", "model_context", "tune.cache", "tune.comm", "tune.hardware",
                "tune.models", "tune.gemm")),
    ("transport", ("comm", "kernels", "trace")),
    ("areas", ("tp", "cp", "hdp", "pp")),
    ("face and planner", ("args", "config", "tune")),
    ("integration", ("integration",)),
    ("package", ("",)),  # megatron_overlap/__init__.py: install, the flags, the errors
    ("lab", ("lab", "kernels.bench")),
    ("commands", ("cli", "__main__")),
)


def _floor(module: str) -> int:
    name = module[len("megatron_overlap."):] if module != "megatron_overlap" else ""
    best = (-1, None)
    for level, (_floor_name, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + ".") or prefix == "" == name:
                best = max(best, (len(prefix), level))
    assert best[1] is not None, f"{module} is on no floor: add it to FLOORS (and docs/architecture.md)"
    return best[1]


def test_every_import_goes_down_or_along_a_floor():
    offenders = [f"{v} ({FLOORS[_floor(v)][0]}) imports {w} ({FLOORS[_floor(w)][0]})"
                 for v, ws in sorted(_graph().items()) for w in sorted(ws) if _floor(w) > _floor(v)]
    assert not offenders, "\n".join(offenders)
    assert _floor("megatron_overlap.tune.cache") < _floor("megatron_overlap.tp.autotune") < _floor(
        "megatron_overlap.tune.strategy_ranking") < _floor("megatron_overlap.integration.install") < _floor(
        "megatron_overlap") < _floor("megatron_overlap.lab.tiny_gpt") < _floor("megatron_overlap.cli.main")


def test_the_architecture_page_lists_the_floors_the_test_checks():
    """docs/architecture.md's table of floors: the same floors in the same order, each naming the
    modules and folders FLOORS puts on it."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == [f"{i}. {name}" for i, (name, _) in enumerate(FLOORS, 1)]
    for row, (_name, prefixes) in zip(rows, FLOORS):
        listed = row.split("|")[2]
        for prefix in prefixes:
            shown = {"": "__init__.py", "__main__": "__main__.py"}.get(prefix, prefix.replace(".", "/"))
            assert f"`{shown}" in listed or f"/{shown}" in listed, (prefix, row)


def _reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
    return seen


def test_install_and_run_reach_no_lab_and_no_command_but_run():
    """Every module ``install`` and ``run`` can load, lazily or not: none of the lab, the
    benches, the demo or the other commands (what ``run`` loads at run time: tests/test_plugin_imports.py)."""
    graph = _graph()
    reached = set()
    for start in ("megatron_overlap", "megatron_overlap.integration.install", "megatron_overlap.integration.launch"):
        reached |= _reachable(graph, start)
    offenders = sorted(m for m in reached if m.startswith(("megatron_overlap.lab", "megatron_overlap.cli",
                                                           "megatron_overlap.kernels.bench")))
    assert not offenders, offenders
    assert "megatron_overlap.integration.schedules" in reached and "megatron_overlap.hdp.runtime" in reached
