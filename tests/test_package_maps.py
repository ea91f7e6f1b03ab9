"""The maps the code keeps of itself, held to the code: a package docstring that lists its
modules lists every one and nothing else; ``config.py`` names every section of
``OverlapConfig``; the pointers of ``cp/ring_context.py`` name functions that exist."""

import ast
import dataclasses
import importlib
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_overlap"
# a map line: four spaces, one or more module names (``x.py``, ``x.py, y.py``) or a folder (``x/``)
_MAP_LINE = re.compile(r"^    ((?:\w+\.py|\w+/)(?:, \w+\.py)*)(?:\s{1,}|$)")


def module_map(doc: str) -> set:
    """The module and folder names a package docstring's map lists (empty: no map)."""
    names = set()
    for line in doc.splitlines():
        m = _MAP_LINE.match(line)
        if m:
            names.update(name.strip() for name in m.group(1).split(","))
    return names


def _packages_with_maps():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        names = module_map(ast.get_docstring(ast.parse(init.read_text()), clean=False) or "")
        if names:
            yield init.parent, names


def test_the_map_reader_reads_the_forms_used():
    doc = "Text.\n\n    a.py   one\n    b.py, c.py\n               two\n    d/     three\n  e.py not a map line\n"
    assert module_map(doc) == {"a.py", "b.py", "c.py", "d/"}


@pytest.mark.parametrize("package", ["lab", "hdp", "tp", "tune", "integration", "trace"])
def test_these_packages_keep_a_map(package):
    assert package in {p.name for p, _ in _packages_with_maps()}


@pytest.mark.parametrize("package,listed", list(_packages_with_maps()), ids=lambda v: getattr(v, "name", ""))
def test_a_package_map_lists_every_module_and_nothing_else(package, listed):
    present = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    present |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert listed - present == set(), f"{package.name}/__init__.py lists modules that do not exist"
    assert present - listed == set(), f"{package.name}/__init__.py does not list these modules"


def test_config_names_every_section():
    from megatron_overlap import config

    sections = {f.name for f in dataclasses.fields(config.OverlapConfig)}
    named = set(re.findall(r"``(\w+)``", config.__doc__.split("one small section per area")[1].split(";")[0]))
    assert named == sections


def test_ring_context_points_at_what_exists():
    from megatron_overlap.cp import ring_context

    pointers = re.findall(r"``((?:integration|cp)\.\w+\.\w+)``", ring_context.__doc__)
    assert len(pointers) >= 2, pointers
    for pointer in pointers:
        module, name = pointer.rsplit(".", 1)
        assert hasattr(importlib.import_module(f"megatron_overlap.{module}"), name), pointer
    for name in re.findall(r":func:`(\w+)`", ring_context.__doc__):
        assert hasattr(ring_context, name), name


# File names more than one module of the package holds, each with why a reader need not guess
# which is meant: an area and its seam into Megatron (integration/), an op and its kernel
# (kernels/), a transport and the backend over it, a command's driver (cli/) and rank side (lab/).
SHARED_NAMES = {
    "checks.py": "each area's model checks (cp, hdp, pp, tp)",
    "attention.py": "cp's attention and its seam into Megatron (integration/)",
    "allreduce_fusion.py": "tp's fused op and its seam into Megatron's layer (integration/)",
    "sub_batches.py": "the cut in Megatron's layer (integration/) and its cost model (tune/)",
    "baselines.py": "HDP's baseline plans (hdp/) and megatron-core's scheduler run as one (integration/)",
    "ag_gemm.py": "tp's ring and its Triton kernel (kernels/)",
    "gemm_rs.py": "tp's ring and its Triton kernel (kernels/)",
    "p2p.py": "comm's P2P exchange and the TP backend over it (tp/backends/)",
    "layout.py": "cp's zigzag layout and HDP's per-micro-batch row layout",
    "demo.py": "the demo's driver (cli/) and its rank side (lab/)",
}
NEVER_SHARED = ("simulate.py", "plan.py", "planner.py", "context.py", "check.py")


def test_no_two_modules_share_a_name_a_reader_must_guess():
    by_name: dict = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert set(shared) <= set(SHARED_NAMES), {n: p for n, p in shared.items() if n not in SHARED_NAMES}
    assert not set(shared) & set(NEVER_SHARED)


def _patched_names(tree) -> list:
    """(line, attribute name) of each ``inst.set_attr(owner, name, value)`` in a module: ``name`` a
    string, or a module-level constant holding one; a name bound elsewhere (a loop's) is skipped."""
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_attr"
                and len(node.args) >= 2):
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((node.lineno, arg.value))
            elif isinstance(arg, ast.Name) and arg.id in constants:
                out.append((node.lineno, constants[arg.id]))
    return out


def test_the_patch_table_names_every_patched_attribute():
    """install.py's table of what the plugin patches in Megatron names each attribute a patch
    in ``integration/`` sets (``inst.set_attr``)."""
    from megatron_overlap.integration import install

    table = "\n".join(line for line in install.__doc__.splitlines() if line.startswith("|"))
    named = set(re.findall(r"\w+", table))
    found = [(path.name, line, name) for path in sorted((PACKAGE / "integration").glob("*.py"))
             for line, name in _patched_names(ast.parse(path.read_text()))]
    assert len(found) >= 20, found  # the walk sees the patches
    missing = [f"integration/{file}:{line} patches {name}" for file, line, name in found if name not in named]
    assert not missing, "\n".join(missing)
