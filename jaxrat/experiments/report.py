"""One study page from what lies under a folder: ``ROOT/report.md`` and ``ROOT/report.html``.

It finds, at any depth under ROOT: sweeps (a folder with ``sweep.json``), searches (a folder with
``optuna_journal.log``), robustness tables (``<workdir>/robustness/table.md``) and single runs (a
folder with ``metrics.jsonl`` outside any sweep). Every table comes from the code that writes the
sweep summary (:mod:`jaxrat.experiments.summary`, :mod:`jaxrat.experiments.stats`) and the search
summary (:mod:`jaxrat.experiments.tune_summary`), so the page's numbers are theirs. Per sweep it
draws the metric curves, lists how each run's config differs from the sweep's first run, and the
machine and jaxrat commit each run recorded in its ``summary.json``. It only reads what the runs
wrote (its own images go to ``ROOT/report_files/``), so it works while jobs are still running.
"""

from __future__ import annotations

import html
import os
import re
import time
from typing import Any

from jaxrat.experiments import summary as sweep_summary
from jaxrat.experiments.status import run_status
from jaxrat.experiments.sweep import MANIFEST
from jaxrat.runtime.dotted import flatten
from jaxrat.runtime.fileio import read_json, write_text

FILES_DIR = "report_files"
SKIP = {"checkpoints", "synthetic_data", "tensorboard", "eval", FILES_DIR, "trials", "folds", "wandb", "mlruns"}


def find(root: str) -> dict[str, list[str]]:
    """The sweeps, searches, robustness folders and single runs under ``root`` (relative paths)."""
    from jaxrat.experiments.tune import JOURNAL

    found: dict[str, list[str]] = {"sweeps": [], "searches": [], "robustness": [], "runs": []}
    in_sweep: set[str] = set()
    for here, dirs, files in os.walk(root):
        rel = os.path.relpath(here, root)
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        if MANIFEST in files:
            found["sweeps"].append(rel)
            in_sweep.update(os.path.normpath(os.path.join(rel, d)) for d in dirs)
        if JOURNAL in files:
            found["searches"].append(rel)
        if os.path.isfile(os.path.join(here, "robustness", "table.md")):
            found["robustness"].append(rel)
        if "metrics.jsonl" in files and os.path.normpath(rel) not in in_sweep:
            found["runs"].append(rel)
    return found


def _read_json(path: str) -> dict[str, Any]:
    data = read_json(path)
    return data if isinstance(data, dict) else {}


# Fields that differ between runs without being part of the experiment.
_NOISE = re.compile(r"^(tracking\.run_name|data\.fold_dir|train\.compilation_cache_dir|distributed\.)")


def config_differences(workdirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per run, the config fields whose value differs from the first run's (``config.json``)."""
    configs = {name: flatten(_read_json(os.path.join(wd, "config.json"))) for name, wd in workdirs.items()}
    if not configs:
        return {}
    first = next(iter(configs.values()))
    out = {}
    for name, c in configs.items():
        keys = sorted(k for k in set(c) | set(first) if c.get(k) != first.get(k) and not _NOISE.match(k))
        out[name] = {k: c.get(k) for k in keys}
    return out


def machines(workdirs: dict[str, str]) -> list[dict[str, Any]]:
    """Each run's machine and code as its ``summary.json`` recorded them (runs without one: not yet)."""
    rows = []
    for name, wd in workdirs.items():
        s = _read_json(os.path.join(wd, "summary.json"))
        hw, code = s.get("hardware") or {}, s.get("code") or {}
        total = _read_json(os.path.join(wd, "config.json")).get("num_train_steps")
        rows.append({"run": name, "status": run_status(wd, total if isinstance(total, int) else None),
                     "devices": f"{hw.get('device_count', '')} x {hw.get('device_kind', '')}" if hw else "",
                     "host": hw.get("host", ""), "commit": (code.get("commit") or "")[:12] +
                     (" (uncommitted changes)" if code.get("dirty") else ""),
                     "wall_time_s": s.get("wall_time_s")})
    return rows


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cell = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|"))  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(v) for v in r) + " |" for r in rows)]


def _slug(rel: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", rel.strip("./")) or "root"


def sweep_section(root: str, rel: str) -> list[str]:
    folder = os.path.join(root, rel)
    runs = sweep_summary.collect(folder)
    title = rel if rel != "." else os.path.basename(os.path.abspath(root))
    lines = [f"## Sweep: {title}", ""]
    if not runs:
        return lines + ["No run has logged metrics yet.", ""]
    text, _ = sweep_summary.study_markdown(folder, runs)
    lines += [text.replace("\n## ", "\n### "), ""]
    image = os.path.join(FILES_DIR, f"curves_{_slug(rel)}.png")
    if sweep_summary.plot(runs, os.path.join(root, image)):
        lines += [f"![metric curves of {title}]({image})", ""]
    workdirs = {r.name: os.path.join(folder, r.name) for r in runs}
    diffs = config_differences(workdirs)
    lines += ["### Config differences (from the first run)", ""]
    lines += _table(["run", "differs in"], [[n, ", ".join(f"{k}={v}" for k, v in d.items()) or "(the reference)"]
                                            for n, d in diffs.items()]) + [""]
    lines += ["### Machines and code", ""]
    m = machines(workdirs)
    lines += _table(["run", "status", "devices", "host", "commit", "wall time (s)"],
                    [[r["run"], r["status"], r["devices"], r["host"], r["commit"], r["wall_time_s"]] for r in m])
    return lines + [""]


def search_section(root: str, rel: str) -> list[str]:
    from jaxrat.experiments import tune_summary

    try:
        s = tune_summary.collect(os.path.join(root, rel))
    except Exception as e:  # a journal being written or from another Optuna: say so, keep the page
        return [f"## Search: {rel}", "", f"Not readable now ({type(e).__name__}: {e}).", ""]
    body = tune_summary.markdown(s).split("\n", 1)[1].replace("\n## ", "\n### ")  # its title names the folder
    return [f"## Search: {rel}", body, ""]


def robustness_section(root: str, rel: str) -> list[str]:
    folder = os.path.join(root, rel, "robustness")
    with open(os.path.join(folder, "table.md")) as f:
        table = f.read()
    lines = [f"## Robustness: {rel}", "", table.replace("\n# ", "\n### ").lstrip("# "), ""]
    if os.path.isfile(os.path.join(folder, "plot.png")):
        lines += [f"![robustness of {rel}]({os.path.relpath(os.path.join(folder, 'plot.png'), root)})", ""]
    return lines


def runs_section(root: str, rels: list[str]) -> list[str]:
    runs = [sweep_summary.summarize_run(os.path.join(root, r), r) for r in rels]
    lines = ["## Single runs", "", sweep_summary.to_markdown(*sweep_summary.table(runs)), ""]
    lines += ["### Machines and code", ""]
    lines += _table(["run", "status", "devices", "host", "commit", "wall time (s)"],
                    [[r["run"], r["status"], r["devices"], r["host"], r["commit"], r["wall_time_s"]]
                     for r in machines({r: os.path.join(root, r) for r in rels})])
    return lines + [""]


def build(root: str) -> str:
    """The page's markdown (and its images under ``ROOT/report_files``)."""
    os.makedirs(os.path.join(root, FILES_DIR), exist_ok=True)
    found = find(root)
    lines = [f"# Study report: {os.path.abspath(root)}", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} from the files under the folder: "
             f"{len(found['sweeps'])} sweep(s), {len(found['searches'])} search(es), "
             f"{len(found['robustness'])} robustness table(s), {len(found['runs'])} single run(s).", ""]
    for rel in found["sweeps"]:
        lines += sweep_section(root, rel)
    for rel in found["searches"]:
        lines += search_section(root, rel)
    for rel in found["robustness"]:
        lines += robustness_section(root, rel)
    if found["runs"]:
        lines += runs_section(root, found["runs"])
    return "\n".join(lines).rstrip() + "\n"


def to_html(markdown: str, title: str) -> str:
    """The page in HTML: headings, tables, images, code spans and paragraphs (what :func:`build` writes)."""
    def inline(text: str) -> str:
        text = html.escape(text)
        return re.sub(r"`([^`]*)`", r"<code>\1</code>", re.sub(r"\*\*([^*]*)\*\*", r"<b>\1</b>", text))

    out, table = [], []

    def flush() -> None:
        if table:
            rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", r.strip()[1:-1])] for r in table]
            out.append("<table>")
            out.append("<tr>" + "".join(f"<th>{inline(c)}</th>" for c in rows[0]) + "</tr>")
            out.extend("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rows[2:])
            out.append("</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if m := re.match(r"^(#{1,6}) (.*)", line):
            n = len(m.group(1))
            out.append(f"<h{n}>{inline(m.group(2))}</h{n}>")
        elif m := re.match(r"^!\[([^\]]*)\]\(([^)]*)\)$", line):
            out.append(f'<p><img src="{html.escape(m.group(2))}" alt="{html.escape(m.group(1))}"></p>')
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
    flush()
    style = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}"
             "td:first-child{text-align:left}img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def write(root: str) -> list[str]:
    """Write ``ROOT/report.md`` and ``ROOT/report.html``; returns their paths."""
    text = build(root)
    paths = [os.path.join(root, "report.md"), os.path.join(root, "report.html")]
    for path, content in zip(paths, (text, to_html(text, f"jaxrat report: {os.path.abspath(root)}"))):
        write_text(path, content)
    return paths
