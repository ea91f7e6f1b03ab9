#!/usr/bin/env python
"""Check the docs against BENCHMARKS.md: every measured figure quoted in README.md or docs/*.md
(a ratio like ``1.45x``, a time like ``28.0 ms``, a percentage) sits in a link to the BENCHMARKS
section that holds it, and every number in such a link appears in that section, so no figure is
restated with another value; every relative link in the docs resolves, anchors included.

    python scripts/check_figures.py      # prints each problem, exit 1 if any

tests/test_docs.py runs it. Code (fenced blocks, `inline`) and docs/flags.md (generated from the
code: settings, not measurements) are not checked for figures.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+x|\d+(?:\.\d+)?\s?ms|\d+(?:\.\d+)?%)(?![\w])")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\d])")


def docs() -> list:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def sections(path: pathlib.Path) -> dict:
    """anchor -> text of that heading's section (down to the next heading of its level or higher)."""
    out = {}
    lines = path.read_text().splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := re.match(r"^(#{1,6}) (.*)$", line))]
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        out[slug(title)] = "\n".join(lines[i:end])
    return out


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def check_file(path: pathlib.Path, bench: dict) -> list:
    problems = []
    text = prose(path.read_text())
    rel = path.relative_to(ROOT)
    for m in LINK.finditer(text):
        label, target = m.groups()
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{rel}: link to {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in sections(dest):
            problems.append(f"{rel}: link to {target}: no heading with that anchor")
            continue
        if dest == BENCHMARKS and NUMBER.search(label):
            if not anchor:
                problems.append(f"{rel}: figure [{label}] links to BENCHMARKS.md without a section")
                continue
            section = bench[anchor]
            for number in NUMBER.findall(label):
                if not re.search(rf"(?<![\w.]){re.escape(number)}(?![\d])", section):
                    problems.append(f"{rel}: [{label}] -> BENCHMARKS.md#{anchor}: {number} is not in that section")
    outside = LINK.sub("", text)
    if path.name == "flags.md":  # generated from the code: its values are settings, not measurements
        return problems
    for m in FIGURE.finditer(outside):
        line = outside[:m.start()].count("\n") + 1
        problems.append(f"{rel}: figure {m.group(1)!r} (near prose line {line}) is not in a link to its "
                        "BENCHMARKS section")
    return problems


def check() -> list:
    bench = sections(BENCHMARKS)
    problems = []
    for path in docs():
        problems += check_file(path, bench)
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
