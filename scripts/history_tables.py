"""Write the measurement history's tables as JSON: docs/history/PAGE.md -> docs/history/results/PAGE.json.

    python scripts/history_tables.py            # rewrite the JSON files from the pages
    python scripts/history_tables.py --check    # exit 1 if a JSON file differs from its page

Each markdown table of a page becomes one record: the section it sits in (its headings, outermost
first), the date its innermost dated heading gives (the first, for a range), the commits and the first
command named in the text between it and the heading or table before it, its column names and its rows
(one object per row, keyed by column). Cells are copied as text, figures and units together, so nothing
is computed or rounded here; the page stays the source.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / "docs" / "history"
RESULTS = HISTORY / "results"
GENERATED = "written by scripts/history_tables.py from the page; edit the page, then rerun it"

_HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_COMMIT = re.compile(r"\b(?:main|commit|at|of|code of) ([0-9a-f]{7,12})\b")
_COMMAND = re.compile(r"`((?:python|bash|BUDGET_S=\S+ OUT=\S+ bash) [^`]+)`")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _is_rule(line: str) -> bool:
    return bool(re.fullmatch(r"\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*\|?", line.strip()))


def tables(markdown: str) -> list[dict]:
    """The tables of one page, each with the section, date, commits and command around it."""
    lines = markdown.splitlines()
    headings: list[tuple[int, str]] = []
    paragraph: list[str] = []
    out: list[dict] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            headings = [h for h in headings if h[0] < level] + [(level, heading.group(2))]
            paragraph = []
        elif line.startswith("|") and i + 1 < len(lines) and _is_rule(lines[i + 1]):
            columns = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                rows.append(dict(zip(columns, cells + [""] * (len(columns) - len(cells)))))
                i += 1
            section = [text for level, text in headings if level > 1]
            dates = [_DATE.findall(text) for text in section if _DATE.search(text)]
            before = " ".join(paragraph)
            out.append({
                "section": section,
                "date": dates[-1][0] if dates else None,
                "commits": sorted(set(_COMMIT.findall(" ".join(section) + " " + before))),
                "command": (_COMMAND.findall(before) or [None])[0],
                "columns": columns,
                "rows": rows,
            })
            paragraph = []
            continue
        elif line.strip():
            paragraph.append(line.strip())
        i += 1
    return out


def results(page: Path) -> dict:
    """The JSON record of one history page."""
    return {"page": page.relative_to(REPO).as_posix(), "note": GENERATED, "tables": tables(page.read_text())}


def pages() -> list[Path]:
    return sorted(p for p in HISTORY.glob("*.md") if p.name != "README.md")


def render(page: Path) -> str:
    return json.dumps(results(page), indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        target = RESULTS / f"{page.stem}.json"
        text = render(page)
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target.relative_to(REPO).as_posix())
        else:
            RESULTS.mkdir(exist_ok=True)
            target.write_text(text)
    if stale:
        print(f"out of date with their pages: {', '.join(stale)}; run python scripts/history_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
