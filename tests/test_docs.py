"""The docs as a reader needs them: a README read in one screen, one page per feature, the
flags page generated from the code, current figures only in BENCHMARKS.md (each with its
command, date, machine and versions), a changelog in Keep a Changelog form, and no figure in
README or docs that BENCHMARKS.md does not hold with the same value."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("getting-started", "flags", "tp-overlap", "context-parallelism", "hdp", "pipelines", "planning",
         "failures", "architecture", "lab", "testing")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def test_readme_fits_a_screen_and_links_every_page():
    readme = _text("README.md")
    assert len(readme.splitlines()) <= 150
    for page in PAGES:
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
        assert f"(docs/{page}.md)" in readme, page
    # the two set-up commands come first, and no install command claims a release
    code = re.findall(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M)
    assert code[0].splitlines()[0].startswith("bash scripts/demo.sh")
    assert code[0].splitlines()[1].startswith("bash scripts/test.sh")
    assert "pip install megatron-overlap" not in readme and "pip install ." in readme
    assert "Nothing has run on a GPU except a first kernel timing" in readme


def test_flags_page_is_generated_from_the_code(capsys):
    assert _script("flags_doc").main(["--check"]) == 0, capsys.readouterr().err
    page = _text("docs/flags.md")
    from megatron_overlap.args import DEPRECATED, FLAGS

    for flag in FLAGS + tuple(DEPRECATED):
        assert f"`{flag}`" in page, flag


def test_config_matrix_page_shows_the_runs_ci_runs(capsys, tmp_path, monkeypatch):
    script = _script("config_matrix")
    assert script.main(["--check"]) == 0, capsys.readouterr().err
    stale = tmp_path / "config-matrix.md"
    stale.write_text(_text("docs/config-matrix.md").replace("`tp-p2p-full`", "`tp-p2p-none`", 1))
    monkeypatch.setattr(script, "PAGE", stale)
    assert script.main(["--check"]) == 1


def test_flags_page_check_fails_when_stale(tmp_path, monkeypatch):
    flags_doc = _script("flags_doc")
    stale = tmp_path / "flags.md"
    stale.write_text(flags_doc.render().replace("--overlap-tp-chunks", "--overlap-chunks", 1))
    monkeypatch.setattr(flags_doc, "PAGE", stale)
    monkeypatch.setattr(flags_doc, "ROOT", tmp_path)
    assert flags_doc.main(["--check"]) == 1


def test_every_figure_in_the_docs_links_to_benchmarks_with_the_same_value():
    problems = _script("check_figures").check()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line,problem", [
    ("zb's exposed DP is [22 ms](../BENCHMARKS.md#pipelines-at-scale-emulated-cluster)", "22 is not in that section"),
    ("the cost model predicts within 3%", "figure '3%'"),
    ("see [here](../BENCHMARKS.md#no-such-section)", "no heading with that anchor"),
    ("[1.45x over stock](../BENCHMARKS.md)", "without a section"),
])
def test_the_figure_check_catches_a_restated_figure(tmp_path, line, problem):
    check_figures = _script("check_figures")
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "BENCHMARKS.md").write_text(_text("BENCHMARKS.md"))
    page = docs / "page.md"
    page.write_text(f"# Page\n\n{line}\n")
    check_figures.ROOT, check_figures.BENCHMARKS = tmp_path, tmp_path / "BENCHMARKS.md"
    problems = check_figures.check_file(page, check_figures.sections(tmp_path / "BENCHMARKS.md"))
    assert any(problem in p for p in problems), problems


def test_benchmarks_hold_current_figures_only_with_their_provenance():
    text = _text("BENCHMARKS.md")
    assert len(text.splitlines()) <= 400
    headings = re.findall(r"^#+ (.*)$", text, flags=re.M)
    assert not [h for h in headings if re.search(r"\b(pass|superseded|re-run|second|third)\b", h, re.I)]
    assert "superseded" not in text.lower()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    for section in sections:
        title = section.splitlines()[0]
        if title in ("How these figures are measured", "Machines and versions"):
            continue
        assert "```bash" in section, title  # the command
        assert re.search(r"20\d\d-\d\d-\d\d", section), title  # the date
        assert "versions" in section or "torch 2." in section, title
        assert re.search(r"AMD EPYC|Intel Xeon|H200|model not recorded", section), title  # the machine
        assert re.search(r"x (the )?(limit|floor)|vs limit|x floor|bound|ceiling|simulated", section), title


def test_changelog_keeps_a_changelog():
    text = _text("CHANGELOG.md")
    assert text.startswith("# Changelog\n")
    versions = re.findall(r"^## (.*)$", text, flags=re.M)
    assert versions and all(re.fullmatch(r"\[Unreleased\]|\[\d+\.\d+\.\d+\] - \d{4}-\d\d-\d\d", v) for v in versions)
    kinds = re.findall(r"^### (.*)$", text, flags=re.M)
    assert kinds and set(kinds) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    # user-visible changes only: no benchmark figures, no suite timings
    assert not re.search(r"\d+\.\d+x\b|\d+(\.\d+)? ?ms\b|\d+ (passed|tests)\b|\d+ min\b", text)


def test_contradictions_once_found_stay_gone():
    docs = {p.name: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    everything = "\n".join(docs.values())
    # HDP runs under a pipeline (tests/test_hdp_runtime.py, tests/test_pretrain_gpt.py), the mode derived
    assert "refuses PP > 1" not in everything and "--hdp-mode pp" not in everything
    assert "with `--pipeline-model-parallel-size > 1` every" in docs["hdp.md"]
    # the cost model's accuracy is stated once, as tests/test_cost_bench.py holds it
    assert "within 3%" not in everything + _text("BENCHMARKS.md")
    # per-section machines: the demo's CPU is named in the demo section, every part from one machine
    demo = _text("BENCHMARKS.md").split("## The CPU demo")[1].split("\n## ")[0]
    assert "AMD EPYC" in demo and "Intel Xeon" not in demo and "model not recorded" not in demo
