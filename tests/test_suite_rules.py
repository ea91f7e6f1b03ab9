"""The test suite's own rules, checked on its source with ``ast`` and on a tiny inner run: no test
module imports another (shared code lives in helper modules, named for what they hold); no
random draw the seed fixture does not print on failure; helpers of a readable length; state a
helper swaps in is put back."""

import ast
import pathlib
import re
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
HELPER_LINES = 430  # a helper holds one area (tests/*_rank_fns.py, rank_helpers.py, ...)


def _sources():
    for path in sorted(TESTS.glob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _relative_imports(tree):
    """The modules of this directory a module imports: ``from .x import y``, ``from . import x``,
    ``import tests.x``, ``from tests.x import y``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                yield node.module.split(".")[0], node.lineno
            elif node.level == 1:
                for alias in node.names:
                    yield alias.name, node.lineno
            elif node.level == 0 and node.module and node.module.split(".")[0] == "tests":
                parts = node.module.split(".")
                yield (parts[1] if len(parts) > 1 else node.names[0].name), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tests" and len(parts) > 1:
                    yield parts[1], node.lineno


def test_no_test_module_imports_another():
    offenders = [f"{path.name}:{line} imports {name}" for path, tree in _sources()
                 for name, line in _relative_imports(tree) if name.startswith("test_")]
    assert not offenders, "\n".join(offenders)
    # the rule catches each spelling
    caught = [name for name, _ in _relative_imports(ast.parse(
        "from .test_a import f\nfrom . import test_b\nimport tests.test_c\nfrom tests.test_d import g\n"))]
    assert caught == ["test_a", "test_b", "test_c", "test_d"]


def test_helpers_are_short_enough_to_read():
    long = [f"{path.name}: {len(path.read_text().splitlines())}" for path, _ in _sources()
            if not path.name.startswith("test_") and len(path.read_text().splitlines()) > HELPER_LINES]
    assert not long, long


# module-level draws of ``random`` and ``numpy.random`` (their hidden global generators), and
# generators seeded from nothing or from the clock
_GLOBAL_DRAWS = {"random", "randrange", "randint", "choice", "choices", "shuffle", "sample", "uniform", "gauss",
                 "normalvariate", "getrandbits", "randbytes", "rand", "randn", "random_sample", "permutation",
                 "default_rng", "integers", "normal"}
_SEEDED = {"Random", "Generator", "manual_seed", "default_rng", "RandomState", "seed"}


def _name(node) -> str:
    return ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""


def unseeded_draws(tree):
    """(line, call) of each draw a failure could not replay: ``random.<draw>(...)``,
    ``numpy.random.<draw>(...)`` on the global generator, ``random.Random()`` or a generator
    seeded without an argument, ``random.SystemRandom``, ``torch.seed()``, and any seed taken
    from the clock (``time.time()``, ``time.time_ns()``, ``perf_counter``) or from ``os.urandom``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        parts = name.split(".")
        last = parts[-1]
        bad = False
        if parts[:-1] == ["random"] and last in _GLOBAL_DRAWS:
            bad = True
        elif parts[:-1] in (["np", "random"], ["numpy", "random"]) and last not in _SEEDED:
            bad = True
        elif last in _SEEDED and name not in ("torch.Generator",) and not node.args and not node.keywords:
            bad = True
        elif name in ("random.SystemRandom", "SystemRandom", "torch.seed", "os.urandom"):
            bad = True
        if last in _SEEDED and any(_name(inner.func) in ("time.time", "time.time_ns", "time.perf_counter",
                                                          "time.monotonic", "os.urandom", "os.getpid")
                                   for arg in node.args for inner in ast.walk(arg) if isinstance(inner, ast.Call)):
            bad = True
        if bad:
            yield node.lineno, ast.unparse(node)[:80]


def test_every_random_draw_can_be_replayed():
    """Random inputs come from the ``seed`` fixture (tests/conftest.py: shown with a failure, and
    replayed by MEGATRON_OVERLAP_TEST_SEED) or from a fixed seed; nothing draws from a
    generator nobody seeded, or from one seeded by the clock."""
    offenders = [f"{path.name}:{line} {call}" for path, tree in _sources() if path.name != "conftest.py"
                 for line, call in unseeded_draws(tree)]
    assert not offenders, "\n".join(offenders)
    caught = sorted(line for line, _ in unseeded_draws(ast.parse(
        "random.randrange(1 << 20)\nrandom.Random()\nrandom.Random(seed)\ntorch.manual_seed(int(time.time()))\n"
        "np.random.rand(3)\nnp.random.default_rng(7)\ntorch.Generator().manual_seed(seed)\nrng.randint(1, 2)\n"
        "torch.seed()\nrandom.SystemRandom().random()\n")))
    assert caught == [1, 2, 4, 5, 9, 10]


_INNER = '''
def test_fails(seed):
    assert seed < 0, "drew=%d" % seed
'''


def _inner_run(tmp_path, capsys) -> str:
    """A one-test pytest session with this suite's conftest as its only plugin: its output."""
    (tmp_path / "test_inner_seed.py").write_text(_INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    code = pytest.main([str(tmp_path / "test_inner_seed.py"), "-q", "-p", "no:cacheprovider", "-c",
                        str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "--import-mode=importlib"],
                       plugins=[sys.modules[__package__ + ".conftest"]])
    assert code == pytest.ExitCode.TESTS_FAILED
    return capsys.readouterr().out


def test_a_failure_shows_its_seed_and_the_seed_replays(tmp_path, capsys, monkeypatch):
    from .conftest import SEED_ENV

    monkeypatch.delenv(SEED_ENV, raising=False)
    out = _inner_run(tmp_path, capsys)
    drew = int(re.search(r"drew=(\d+)", out).group(1))
    assert f"seed {drew}; replay: {SEED_ENV}={drew} bash scripts/test.sh" in out, out
    monkeypatch.setenv(SEED_ENV, str(drew + 1))
    assert f"drew={drew + 1}" in _inner_run(tmp_path, capsys)  # the replay runs with the given seed


def test_the_reference_symm_mem_ops_are_put_back():
    """``rank_helpers.reference_symm_mem`` swaps the reference ops in for its block only, even when
    the block raises (tests/test_backends.py checks the same on the ranks after a run)."""
    from megatron_overlap.tp.backends import symm_mem

    from .rank_helpers import reference_symm_mem, symm_mem_ops_in_use

    before = symm_mem.TorchSymmMemOps, symm_mem.availability
    with reference_symm_mem():
        assert symm_mem_ops_in_use()[0] == "ReferenceSymmMemOps" and symm_mem.availability()[0]
    assert (symm_mem.TorchSymmMemOps, symm_mem.availability) == before
    with pytest.raises(ZeroDivisionError), reference_symm_mem():
        1 / 0
    assert (symm_mem.TorchSymmMemOps, symm_mem.availability) == before


_WORK_NUMBER = re.compile(r"\bissue[ -]#?\d+|\bissue: [a-z-]+|\bissue \d+'s", re.IGNORECASE)


def work_numbers(text: str) -> list:
    """Internal work numbers a reader cannot look up ("issue 23", "issue-24", "(issue: pipeline)");
    an upstream project's own issue, named with its project ("Megatron-LM issue #4385"), may stay."""
    return [m.group(0) for m in _WORK_NUMBER.finditer(text)
            if not text[max(0, m.start() - 12):m.start()].rstrip().endswith("Megatron-LM")]


def test_no_internal_work_numbers_in_code_tests_or_scripts():
    root = TESTS.parent
    files = [p for d in ("megatron_overlap", "tests", "scripts", "examples") for p in sorted((root / d).rglob("*"))
             if p.suffix in (".py", ".sh", ".txt", ".md", ".sbatch") and p != pathlib.Path(__file__)]
    offenders = [f"{p.relative_to(root)}: {hits}" for p in files if (hits := work_numbers(p.read_text()))]
    assert not offenders, "\n".join(offenders)
    assert work_numbers("x (issue 23) y issue-24 z (issue: scale-lab) Issue 25's w") == [
        "issue 23", "issue-24", "issue: scale-lab", "Issue 25"]
    assert work_numbers("Megatron-LM issue #4385; a rank issues 3 sends") == []
