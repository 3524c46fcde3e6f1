"""Predict a list of image files into an output folder (what ``python -m jaxrat.predict`` runs).

Each process reads its share of the images (every P-th), decodes them as evaluation does (JPEGs
at a reduced scale no smaller than the model input, turned upright by their EXIF orientation),
predicts them in batches and writes each image's files; the rows of the CSV/JSON go to a part file
per process, and process 0 merges them once every process is done. An unreadable file is listed in
``skipped.txt`` and the rest continue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
import uuid
from typing import Any, Sequence

import numpy as np

from jaxrat.data.imageio import BadFileError, load_rgb_with_size
from jaxrat.inference import writers
from jaxrat.inference.inputs import InputImage
from jaxrat.runtime import output_folder
from jaxrat.runtime.errors import DataError


@dataclasses.dataclass
class Options:
    """What to write and how: see ``python -m jaxrat.predict --help``."""

    save_probs: str = ""
    tile: int = 0
    overlap: float = 0.5
    top_k: int = 0
    min_score: float = 0.3


class Progress:
    """One stderr line rewritten in place: done/total, rate and time left (plain text, no dependency)."""

    def __init__(self, total: int, enabled: bool = True, what: str = "predict") -> None:
        self.total, self.enabled, self.what = total, enabled, what
        self.t0, self.done, self._last = time.monotonic(), 0, 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.5 and self.done < self.total):
            return
        self._last = now
        rate = self.done / max(now - self.t0, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else 0
        bar = "#" * int(20 * self.done / max(self.total, 1))
        sys.stderr.write(f"\r{self.what}: [{bar:<20}] {self.done}/{self.total} images, {rate:.1f} img/s, "
                         f"ETA {int(left) // 60}:{int(left) % 60:02d}  ")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# Per image, the files a prediction may write ({stem}: see writers.output_names); the manifest lists
# them all, so --overwrite removes a previous run's files whatever its task and options were.
PER_IMAGE_FILES = ("masks/{stem}.png", "probs/{stem}.png", "probs/{stem}.npy", "overlays/{stem}.jpg",
                   "boxes/{stem}.jpg")


def check_output(out: str, inputs: Sequence[InputImage], input_spec: str,
                 guarded: Sequence[output_folder.Guarded] = ()) -> None:
    """Refuse (one sentence, before any work) an ``out`` that is, contains or lies inside the input
    folder, an input file, a ``guarded`` path (the run's files, its dataset) or a training workdir,
    or that cannot be written or is full. The folder exists afterwards."""
    src = os.path.expanduser(input_spec)
    folder = [output_folder.Guarded(src, "the input folder")] if os.path.isdir(src) else []
    output_folder.check(out, [*folder, *guarded], command="predict", input_files=[i.path for i in inputs])


def claim_output(out: str, inputs: Sequence[InputImage], overwrite: bool) -> None:
    """An empty ``out``, or with ``overwrite`` one a prediction wrote (only its listed files are
    removed); then the manifest of what this prediction writes."""
    output_folder.claim(out, command="predict", overwrite=overwrite,
                        files=[n for n in writers.OUTPUT_NAMES if "." in n.lstrip(".")],
                        each=PER_IMAGE_FILES, stems=list(writers.output_names(inputs).values()))
    for name in os.listdir(out):  # part files of a prediction killed before it merged them (the lock is ours)
        if name == ".parts" or name.startswith(".parts-"):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def prepare_output(out: str, inputs: Sequence[InputImage], input_spec: str, overwrite: bool,
                   guarded: Sequence[output_folder.Guarded] = ()) -> None:
    """:func:`check_output`, then :func:`claim_output` (the command takes the folder's lock between them)."""
    check_output(out, inputs, input_spec, guarded)
    claim_output(out, inputs, overwrite)


def read(item: InputImage, predictor: Any, full: bool) -> tuple[np.ndarray, tuple[int, int]]:
    """(pixels, full (h, w)): decoded at a reduced JPEG scale no smaller than the model input unless ``full``."""
    s = predictor.image_size
    image, (w, h) = load_rgb_with_size(item.path, None if full else (s, s))
    return image, (h, w)


def predict_files(predictor: Any, inputs: Sequence[InputImage], out: str, options: Options, *,
                  process_index: int = 0, process_count: int = 1, progress: bool = True,
                  sync: Any = None, run_id: str = "") -> dict[str, Any]:
    """Predict ``inputs`` into ``out`` (prepared by :func:`prepare_output`); returns counts.

    The part files go to ``OUT/.parts-RUN_ID`` (every process passes the same ``run_id``; a single
    process draws one), so a second prediction into the folder never reads or removes this one's."""
    stems = writers.output_names(inputs)
    mine = list(inputs)[process_index::process_count]
    run_id = run_id or (uuid.uuid4().hex if process_count == 1 else "shared")
    parts = parts_dir(out, run_id)
    rows: list[dict] = []
    results: list[dict] = []
    skipped: list[str] = []
    bar = Progress(len(mine), progress and process_index == 0)
    ids = {i.name: k + 1 for k, i in enumerate(inputs)}
    batch: list[tuple[InputImage, np.ndarray, tuple[int, int]]] = []

    def flush() -> None:
        if not batch:
            return
        if options.tile:
            preds = [predictor.predict_tiled(im, options.tile, options.overlap) for _, im, _ in batch]
        else:
            preds = predictor.predict([im for _, im, _ in batch], [hw for _, _, hw in batch])
        for (item, image, _), pred in zip(batch, preds):
            _write_one(predictor, out, stems[item.name], item, image, pred, options, ids[item.name], rows, results)
        bar.update(len(batch))
        batch.clear()

    for item in mine:
        try:
            image, hw = read(item, predictor, full=bool(options.tile))
        except (BadFileError, DataError, OSError) as e:
            skipped.append(f"{item.path}: {getattr(e, 'problem', None) or e}")
            bar.update()
            continue
        batch.append((item, image, hw))
        if len(batch) >= predictor.batch_size:
            flush()
    flush()
    try:
        os.makedirs(parts, exist_ok=True)  # only now: a prediction stopped before leaves no folder behind
        writers.write_json(os.path.join(parts, f"part-{process_index:05d}.json"),
                           {"rows": rows, "results": results, "skipped": skipped})
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(parts)
        raise
    if sync is not None:
        sync()
    if process_index == 0:
        return merge_parts(predictor, out, inputs, process_count, run_id)
    return {"images": len(rows), "skipped": len(skipped)}


def parts_dir(out: str, run_id: str) -> str:
    """``OUT/.parts-RUN_ID``: one prediction's part files."""
    return os.path.join(out, f".parts-{run_id}")


def _write_one(predictor: Any, out: str, stem: str, item: InputImage, image: np.ndarray, pred: Any,
               options: Options, image_id: int, rows: list, results: list) -> None:
    row: dict[str, Any] = {"image": item.name}
    if predictor.kind == "segmentation":
        names = getattr(predictor.task, "class_names", ()) if getattr(predictor.task, "num_classes", 1) > 1 else ()
        row.update(writers.write_segmentation(out, stem, image, pred, options.save_probs, names))
    elif predictor.kind == "classification":
        k = options.top_k or int(predictor.config.task.get("top_k", 5))
        row.update(writers.classification_row(pred, predictor.task.heads, predictor.label_name, k))
    else:
        found = writers.detection_results(pred, image_id, predictor.category_ids)
        for r in found:
            r["category_name"] = predictor.category_names[predictor.category_ids.index(r["category_id"])]
        results.extend(found)
        writers.draw_boxes(out, stem, image, pred, predictor.category_names, options.min_score)
        row.update({"width": pred.width, "height": pred.height, "image_id": image_id,
                    "detections": int(np.sum(pred.scores >= options.min_score))})
    rows.append(row)


def merge_parts(predictor: Any, out: str, inputs: Sequence[InputImage], process_count: int,
                run_id: str) -> dict[str, Any]:
    """Process 0: every process's part file into the CSV (and JSON), in input order."""
    parts = parts_dir(out, run_id)
    rows, results, skipped = [], [], []
    for p in range(process_count):
        with open(os.path.join(parts, f"part-{p:05d}.json")) as f:
            part = json.load(f)
        rows += part["rows"]
        results += part["results"]
        skipped += part["skipped"]
    order = {i.name: k for k, i in enumerate(inputs)}
    rows.sort(key=lambda r: order[r["image"]])
    writers.write_csv(os.path.join(out, "predictions.csv"), rows)
    if predictor.kind == "detection":
        results.sort(key=lambda r: (r["image_id"], -r["score"]))
        writers.write_json(os.path.join(out, "detections.json"), results)
        writers.write_json(os.path.join(out, "images.json"), {
            "images": [{"id": r["image_id"], "file_name": r["image"], "width": r["width"], "height": r["height"]}
                       for r in rows],
            "categories": [{"id": c, "name": n} for c, n in zip(predictor.category_ids, predictor.category_names)]})
    if skipped:
        with open(os.path.join(out, "skipped.txt"), "w") as f:
            f.write("".join(s + "\n" for s in skipped))
    shutil.rmtree(parts, ignore_errors=True)
    return {"images": len(rows), "skipped": len(skipped)}
