#!/usr/bin/env python
"""Write the run table of docs/config-matrix.md from the matrix's design (tests/matrix_design.py),
so the page cannot disagree with what CI runs. ``--check``: exit 1 if the page is stale
(tests/test_docs.py runs it).

    python scripts/config_matrix.py            # rewrite the table in docs/config-matrix.md
    python scripts/config_matrix.py --check
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config-matrix.md"
BEGIN, END = "<!-- matrix table: scripts/config_matrix.py -->", "<!-- end of matrix table -->"
sys.path.insert(0, str(ROOT))


def render(page: str) -> str:
    from tests.matrix_design import markdown_table

    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    if BEGIN not in page or END not in page:
        print(f"{PAGE}: no table markers ({BEGIN} ... {END})", file=sys.stderr)
        return 1
    fresh = render(page)
    if args.check:
        if fresh != page:
            print(f"{PAGE} is stale: run python scripts/config_matrix.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
