"""Measurements live in the history, not in the code, and the docs cite only what a clone has.

- ``docs/history/results/PAGE.json`` holds exactly the tables of ``docs/history/PAGE.md``
  (``scripts/history_tables.py`` writes them), and every current figure of ``results/current.json`` is
  quoted word for word in the history section it names, with its command on ``docs/benchmarks.md``;
- no doc, docstring, comment or script cites a path outside the repository (``../shared/...``,
  ``/work/...``: a fact is stated, not where it sat on one machine);
- no comment or docstring in ``jaxrat/ops`` carries a dated measurement (a date, a commit, or a figure in
  milliseconds, gigabytes or FLOP/s): the code keeps the decision and its reason, the history the figures.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HISTORY = REPO / "docs" / "history"

_HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
# A path that climbs out of where it is read from: markdown links resolve against their page's folder,
# anything else (inline code, prose, comments) against the repository's root, which it cannot climb out of.
_CLIMB = re.compile(r"(?<![\w.>/}\]-])(?:\.\./)+[\w./-]*")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root)/[\w.-]+")
# A measurement as the code's comments used to date them: a day, a commit, or a figure in a unit of time,
# of bytes moved or of throughput. Sizes that are design choices (KiB/MiB budgets, "4 KB of parameters")
# and counts (kernels, registers, elements) stay allowed.
_DATED = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"
    r"|\b(?:main|commit)\s+[0-9a-f]{7,40}\b"
    r"|\d(?:[\d.,]*\d)?\s?(?:ms|µs|ns|GB|GiB|TB|GB/s|TB/s|TFLOP/s|GFLOP/s|images/s|steps/s)(?![\w/])")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(page: Path, title: str) -> str | None:
    """The text under heading ``title`` of ``page``, down to the next heading of its level or above."""
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and m.group(2) == title:
            body = []
            for rest in lines[i + 1:]:
                n = _HEADING.match(rest)
                if n and len(n.group(1)) <= len(m.group(1)):
                    break
                body.append(rest)
            return "\n".join(body)
    return None


def test_each_history_page_s_json_holds_its_tables():
    history_tables = _load_script("history_tables")
    pages = history_tables.pages()
    assert {p.name for p in pages} >= {"cpu.md", "gpu_h100.md", "gpu_cost_model.md"}
    for page in pages:
        written = json.loads((HISTORY / "results" / f"{page.stem}.json").read_text())
        assert written == json.loads(history_tables.render(page)), (
            f"{page.name}'s JSON is stale: run python scripts/history_tables.py")
        assert written["tables"] and all(t["rows"] for t in written["tables"])


def test_the_table_reader_keeps_cells_section_date_commit_and_command():
    page = ("# T\n\n## A run (2026-11-20)\n\n### Later (2026-11-21, main abc1234)\n\n"
            "`python benchmarks/x.py --y 1` at commit 1234567:\n\n| what | result |\n| --- | --- |\n"
            "| step | **4.0 ms** (3.9-4.2) |\n| other | 2 |\n\nText.\n")
    (table,) = _load_script("history_tables").tables(page)
    assert table["section"] == ["A run (2026-11-20)", "Later (2026-11-21, main abc1234)"]
    assert table["date"] == "2026-11-21" and table["commits"] == ["1234567", "abc1234"]
    assert table["command"] == "python benchmarks/x.py --y 1"
    assert table["rows"] == [{"what": "step", "result": "**4.0 ms** (3.9-4.2)"}, {"what": "other", "result": "2"}]


def test_every_current_figure_is_quoted_in_its_history_section():
    current = json.loads((HISTORY / "results" / "current.json").read_text())["figures"]
    benchmarks_page = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(current) >= 10 and len({f["id"] for f in current}) == len(current)
    for figure in current:
        page = REPO / figure["source"]["page"]
        assert page.parent == HISTORY and page.is_file(), figure["id"]
        text = _section(page, figure["source"]["section"])
        assert text is not None, f"{figure['id']}: {page.name} has no section {figure['source']['section']!r}"
        assert figure["value"] in text.replace("**", ""), f"{figure['id']}: {figure['value']!r} not in its section"
        assert figure["date"] in figure["source"]["section"] or figure["date"] in text, figure["id"]
        assert f"`{figure['command']}`" in benchmarks_page, f"{figure['id']}: its command is not on docs/benchmarks.md"


def _cited_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for folder in ("jaxrat", "benchmarks", "scripts"):
        files += sorted(p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh", ".md", ".json"))
    return files


def outside_paths(text: str, where: Path) -> list[str]:
    """Paths in ``text`` (the contents of file ``where``) that lead outside the repository."""
    found = _MACHINE_PATH.findall(text)
    links = set()
    if where.suffix == ".md":
        for m in _LINK.finditer(text):
            links.add(m.start(1))
            target = (where.parent / m.group(1).split("#", 1)[0]).resolve()
            if REPO.resolve() not in (target, *target.parents):
                found.append(m.group(1))
    found += [m.group(0) for m in _CLIMB.finditer(text) if m.start() not in links]
    return found


def test_no_doc_or_source_cites_a_path_outside_the_repository():
    problems = [f"{p.relative_to(REPO)}: {hit}" for p in _cited_files() for hit in outside_paths(p.read_text(), p)]
    assert not problems, "\n".join(problems)


def test_the_outside_path_check_tells_links_from_climbs():
    page = HISTORY / "cpu.md"
    assert outside_paths("see [the index](README.md) and [benchmarks](../benchmarks.md#x)", page) == []
    assert outside_paths("`<workdir>/../jax_cache`, a/../b", page) == []
    assert outside_paths("[kit](../../../shared/gpu/x.py)", page) == ["../../../shared/gpu/x.py"]
    assert outside_paths("(`profile_step.py` of ../shared/gpu)", page) == ["../shared/gpu"]
    assert outside_paths("# read /work/main/notes.md first", REPO / "jaxrat" / "x.py") == ["/work/main"]


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every line of a module's, class's or function's docstring."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines = source.splitlines()[first.lineno - 1:first.end_lineno]
                out += [(first.lineno + i, line) for i, line in enumerate(lines)]
    return out


def dated_measurements(source: str) -> list[tuple[int, str]]:
    return [(line, m.group(0)) for line, text in comments_and_docstrings(source) for m in _DATED.finditer(text)]


OPS_FILES = sorted((REPO / "jaxrat" / "ops").rglob("*.py"))


@pytest.mark.parametrize("path", OPS_FILES, ids=lambda p: str(p.relative_to(REPO / "jaxrat" / "ops")))
def test_no_dated_measurement_in_the_ops_comments(path):
    hits = dated_measurements(path.read_text())
    assert not hits, "\n".join(f"{path.relative_to(REPO)}:{line}: {hit!r} (move it to docs/history/)"
                               for line, hit in hits)


def test_the_dated_measurement_check_reads_only_prose_and_fires_on_figures():
    code = '''"""A kernel.

Measured on an H100 on 2026-11-27: 3.7 ms forward + backward (main b3f90b6), 24.2 GB a step.
"""
BLOCK = 512 * 1024  # 2 MiB of float32; CUDA passes at most 4 KB of parameters, 749 kernels
LIMIT_MS = "3 ms"  # a string in code is not a comment


def f(x):
    """Tiles of 64 x 64 and 16 Ki elements; ceil(k/s) blocks; the 2.0 GB/s of the link, 1.5 TFLOP/s."""
    return x * 2.0  # 8 warps
'''
    hits = [hit for _, hit in dated_measurements(code)]
    assert hits == ["2026-11-27", "3.7 ms", "main b3f90b6", "24.2 GB", "2.0 GB/s", "1.5 TFLOP/s"]
