"""The package's shape, checked on its source with ``ast`` (nothing is imported): only the
integration layer and the lab touch Megatron or patch anything, kernels know no
torch.distributed, no module state behind ``global``, no flag spelled below the config layer,
files and functions small enough to read."""

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


@pytest.mark.parametrize("limit_lines,limit_fn", [(400, 80)])
def test_files_and_functions_are_small_enough_to_read(limit_lines, limit_fn):
    long_files = [f"{rel}: {len((PACKAGE / rel).read_text().splitlines())}" for rel, _ in _modules()
                  if len((PACKAGE / rel).read_text().splitlines()) > limit_lines]
    long_fns = [f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}" for rel, tree in _modules()
                for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > limit_fn]
    assert not long_files and not long_fns, long_files + long_fns
