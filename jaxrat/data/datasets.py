"""From a ``config.data`` section to the train and validation :class:`~jaxrat.data.pipeline.ExampleSource`.

Handles, in order: the synthetic dataset, staging to node-local disk, the bad-file policy (with
``WORKDIR/skipped_files.txt`` written by process 0), the split file, and the source format
(``files``: the official folders; ``tfds``: the ArrayRecord made by ``python -m jaxrat.data.prepare_isic``).

A dataset folder (``config.data.data_dir``) is the user's and only ever read: synthetic data is
written under the workdir, and only when no ``data_dir`` is given (a given one wins, so any
variant trains on real data when pointed at it; a command reading a trained run reads the run's
copy, :mod:`jaxrat.data.synthetic.location`); staged copies go to ``stage_to_local_dir``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from jaxrat.data import folds, label_check
from jaxrat.data.badfiles import SKIPPED_FILES_NAME, BadFilePolicy, refuse_once
from jaxrat.data.pipeline import ExampleSource
from jaxrat.data.sources import isic
from jaxrat.data.synthetic import isic as synthetic_isic
from jaxrat.data.synthetic import location
from jaxrat.runtime.errors import ConfigError, DataError

SEGMENTATION_DATASETS = ("isic2018", "folder")
SOURCES = ("files", "tfds")


def _get(cfg: Any, name: str, default: Any) -> Any:
    return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def synthetic_image_size(data_cfg: Any) -> int:
    """The side synthetic images are generated at: ``data.synthetic_image_size``, or ``data.image_size``
    when that is 0 (or absent, in configs written before the field existed)."""
    return int(_get(data_cfg, "synthetic_image_size", 0) or data_cfg.image_size)


def note_synthetic_off(data_dir: str) -> None:
    """The log line of a synthetic variant pointed at a dataset (the README promises it)."""
    logging.info("data: synthetic data off: config.data.data_dir=%s is given, so training reads that dataset "
                 "(and never writes into it)", data_dir)


def _bad_file_policy(data_cfg: Any, workdir: str, process_index: int) -> BadFilePolicy:
    """``data.on_bad_file``, recording the skipped files in the workdir from process 0 only."""
    record = os.path.join(workdir, SKIPPED_FILES_NAME) if process_index == 0 else None
    return BadFilePolicy(_get(data_cfg, "on_bad_file", "fail"), record)


def _staged(data_cfg: Any, data_dir: str) -> str:
    """``data_dir``, or its copy on node-local disk when ``data.stage_to_local_dir`` is set."""
    local = os.path.expanduser(_get(data_cfg, "stage_to_local_dir", "") or "")
    if not local:
        return data_dir
    from jaxrat.data import staging

    return staging.stage(data_dir, local)


@refuse_once
def resolve_segmentation(
    data_cfg: Any, workdir: str, *, seed: int, process_index: int, num_classes: int = 1
) -> tuple[ExampleSource, ExampleSource]:
    """(train, validation) for ``config.data``; writes the synthetic dataset first when asked.
    ``num_classes`` (the model's): 1 reads masks as binary, more as class maps (``data.name="folder"``; ISIC's
    binary masks are then the classes 0 and 1). With
    ``data.eval_split`` ("train", "validation" or "test"; set by ``jaxrat.evaluate --split``) the
    second source is that split."""
    if data_cfg.name not in SEGMENTATION_DATASETS:
        raise ConfigError(f"Unknown dataset config.data.name={data_cfg.name!r}; "
                          f"use one of {list(SEGMENTATION_DATASETS)}.")
    source = _get(data_cfg, "source", "files")
    if source not in SOURCES:
        raise ConfigError(f"config.data.source={source!r}; use one of {list(SOURCES)}.")
    policy = _bad_file_policy(data_cfg, workdir, process_index)
    eval_split = _get(data_cfg, "eval_split", "validation") or "validation"
    if eval_split not in ("train", "validation", "test"):
        raise ConfigError(f"Evaluation split {eval_split!r}; use train, validation or test.")
    if data_cfg.name == "folder":
        return _folder_segmentation(data_cfg, workdir, policy, eval_split, seed=seed, process_index=process_index,
                                    num_classes=num_classes)
    if eval_split == "test" and data_cfg.synthetic and not (data_cfg.data_dir or ""):
        raise ConfigError("The synthetic dataset has no test split; evaluate --split validation or train, or point "
                          "--config.data.data_dir at ISIC 2018 with its test ground truth.")
    if source == "tfds":
        return _isic_arrayrecord(data_cfg, policy, eval_split)
    return _isic_files(data_cfg, workdir, policy, eval_split, seed=seed, process_index=process_index)


def _isic_arrayrecord(data_cfg: Any, policy: BadFilePolicy,
                      eval_split: str) -> tuple[ExampleSource, ExampleSource]:
    """ISIC 2018 from the ArrayRecord files ``python -m jaxrat.data.prepare_isic`` writes."""
    from jaxrat.data.sources import isic_arrayrecord

    if folds.settings(data_cfg)[0]:
        raise ConfigError("config.data.folds applies to source='files'; cross-validate on the image folders "
                          "(--config.data.source=files) or set --config.data.folds=0.")
    tfds_dir = os.path.expanduser(data_cfg.data_dir or "") or os.path.join(isic.default_data_dir(), "tfds")
    return tuple(  # type: ignore[return-value]
        isic_arrayrecord.example_source(tfds_dir, split, policy, _get(data_cfg, "split_file", ""))
        for split in ("train", eval_split)
    )


def _isic_files(data_cfg: Any, workdir: str, policy: BadFilePolicy, eval_split: str, *, seed: int,
                process_index: int) -> tuple[ExampleSource, ExampleSource]:
    """ISIC 2018 from its official image and mask folders (or the synthetic stand-in written in their
    layout), with validation a fold of the training split when ``data.folds`` is set."""
    data_dir = os.path.expanduser(data_cfg.data_dir or "")
    if data_cfg.synthetic and data_dir:
        note_synthetic_off(data_dir)
    elif data_cfg.synthetic:
        data_dir = synthetic_isic.write_dataset(location.folder(workdir, process_index), data_cfg.synthetic_train,
                                                data_cfg.synthetic_val, synthetic_image_size(data_cfg), seed,
                                                found_in=location.run_copies(process_index))
    data_dir = data_dir or isic.default_data_dir()
    if _get(data_cfg, "stage_to_local_dir", "") and not os.path.isdir(data_dir):
        isic.find_pairs(data_dir, "train")  # raises the helpful "not found" message
    data_dir = _staged(data_cfg, data_dir)
    split_file = _get(data_cfg, "split_file", "")
    stats = label_check.HistogramCache(os.path.join(workdir, label_check.LABEL_STATS_NAME), binary=True)
    if folds.settings(data_cfg)[0]:  # validation is a fold of the training split
        pairs = isic.find_pairs(data_dir, "train", split_file=split_file, policy=policy)
        ids = [os.path.splitext(os.path.basename(img))[0] for img, _ in pairs]
        parts = folds.split(pairs, ids, data_cfg, process_index=process_index, workdir=workdir)
        assert parts is not None
        k, fold = folds.settings(data_cfg)[:2]
        label_check.check_binary_split(parts[0], f"train-fold{fold}of{k}", stats)
        label_check.check_binary_split(parts[1], f"fold{fold}of{k}", stats)
        return (ExampleSource(parts[0], policy=policy, name=f"isic2018/train-fold{fold}of{k}"),
                ExampleSource(parts[1], policy=policy, name=f"isic2018/fold{fold}of{k}"))
    out = []
    for split in ("train", eval_split):
        pairs = isic.find_pairs(data_dir, split, split_file=split_file, policy=policy)
        label_check.check_binary_split(pairs, split, stats)
        out.append(ExampleSource(pairs, policy=policy, name=f"isic2018/{split}"))
    return out[0], out[1]


def _folder_segmentation(data_cfg: Any, workdir: str, policy: BadFilePolicy, eval_split: str, *, seed: int,
                         process_index: int, num_classes: int) -> tuple[ExampleSource, ExampleSource]:
    """Any images/ + masks/ dataset (:mod:`jaxrat.data.sources.segmentation_folder`): binary masks with
    ``model.num_classes`` 1, class maps otherwise; folds and the bad-file policy as for ISIC."""
    from jaxrat.data.sources import segmentation_folder as sf
    from jaxrat.data.synthetic import segmentation as synthetic_segmentation

    data_dir = os.path.expanduser(data_cfg.data_dir or "")
    if data_cfg.synthetic and data_dir:
        note_synthetic_off(data_dir)
    if data_cfg.synthetic and not data_dir:
        data_dir = synthetic_segmentation.write_dataset(
            location.folder(workdir, process_index), data_cfg.synthetic_train + data_cfg.synthetic_val,
            synthetic_image_size(data_cfg), seed, found_in=location.run_copies(process_index))
    if not data_dir:
        raise ConfigError("config.data.data_dir is empty; point it at the folder holding images/ and masks/.")
    data_dir = _staged(data_cfg, data_dir)
    total = data_cfg.synthetic_train + data_cfg.synthetic_val
    fraction = (data_cfg.synthetic_val / total if data_cfg.synthetic and total and not data_cfg.data_dir
                else float(_get(data_cfg, "val_fraction", 0.2)))
    kw = dict(images=_get(data_cfg, "images_folder", "images"), masks=_get(data_cfg, "masks_folder", "masks"),
              pairs_csv=_get(data_cfg, "pairs_csv", ""), val_fraction=fraction, seed=seed, policy=policy)
    label_map = tuple(tuple(p) for p in _get(data_cfg, "label_map", ()))
    loader = isic.DecodePair() if num_classes == 1 else sf.DecodeLabelPair(num_classes, label_map)
    stats = label_check.HistogramCache(os.path.join(workdir, label_check.LABEL_STATS_NAME), binary=num_classes == 1)

    def check_labels(pairs: list, split: str) -> None:
        if num_classes == 1:  # thresholded: no ignore value, and label_map does not apply
            label_check.check_binary_split(pairs, split, stats)
        else:
            label_check.check_split(pairs, split, num_classes, sf.label_table(label_map, num_classes), stats)
    if folds.settings(data_cfg)[0]:
        pairs = sf.find_pairs(data_dir, "train", **kw) + sf.find_pairs(data_dir, "validation", **kw)
        pairs = isic.check_pairs(sorted(pairs), policy, f"the dataset in {data_dir}")
        parts = folds.split(pairs, [os.path.relpath(p[0], data_dir) for p in pairs], data_cfg,
                            process_index=process_index, workdir=workdir)
        assert parts is not None
        k, fold = folds.settings(data_cfg)[:2]
        check_labels(parts[0], f"train-fold{fold}of{k}")
        check_labels(parts[1], f"fold{fold}of{k}")
        return (ExampleSource(parts[0], loader, policy, f"folder/train-fold{fold}of{k}"),
                ExampleSource(parts[1], loader, policy, f"folder/fold{fold}of{k}"))
    out = []
    for split in ("train", eval_split):
        pairs = isic.check_pairs(sf.find_pairs(data_dir, split, **kw), policy, f"the {split} split of {data_dir}")
        if not pairs and split == "test":
            raise DataError(f"{data_dir} has no test split (a test/ folder holding images/ and masks/, or rows "
                            f"with split=test in the pairs CSV); evaluate --split validation or train instead.")
        if not pairs:
            raise DataError(f"No image/mask pairs for the {split} split in {data_dir}; check the folders "
                            f"(or --config.data.val_fraction).")
        check_labels(pairs, split)
        out.append(ExampleSource(pairs, loader, policy, f"folder/{split}"))
    return out[0], out[1]


CLASSIFICATION_SOURCES = ("csv", "folder")


@refuse_once
def resolve_classification(
    data_cfg: Any, heads: tuple[str, ...], workdir: str, *, seed: int, process_index: int
) -> tuple[ExampleSource, ExampleSource, dict[str, list], tuple[int, ...]]:
    """(train, validation, vocabularies, classes per head) for a classification ``config.data``.

    ``source="csv"``: ``data_dir/train_csv`` and ``data_dir/val_csv`` with an image column and one
    column per head; ``source="folder"``: ``data_dir/train/<class>/*`` and ``data_dir/val/<class>/*``
    (one head). Text labels of both splits share one vocabulary, in sorted order, so a class index
    means the same in training and evaluation; the classes per head are what the labels need.
    """
    from jaxrat.data.sources import folder
    from jaxrat.data.synthetic import classification as synthetic_classification

    source = _get(data_cfg, "source", "csv")
    if source not in CLASSIFICATION_SOURCES:
        raise ConfigError(f"config.data.source={source!r}; use one of {list(CLASSIFICATION_SOURCES)}.")
    policy = _bad_file_policy(data_cfg, workdir, process_index)
    data_dir = os.path.expanduser(data_cfg.data_dir or "")
    csvs = _get(data_cfg, "train_csv", "train.csv"), _get(data_cfg, "val_csv", "val.csv")
    if data_cfg.synthetic and not data_dir:
        written = synthetic_classification.write_dataset(
            location.folder(workdir, process_index), data_cfg.synthetic_train, data_cfg.synthetic_val,
            synthetic_image_size(data_cfg), seed, found_in=location.run_copies(process_index))
        data_dir = os.path.dirname(written["train"])
        source, csvs = "csv", (written["train"], written["validation"])
    if not data_dir:
        raise ConfigError("config.data.data_dir is empty; point it at the folder of your images (and CSVs).")
    data_dir = _staged(data_cfg, data_dir)
    by_folds = bool(folds.settings(data_cfg)[0])  # validation is a fold of train/: no split of its own
    if source == "folder":
        splits = _class_folder_splits(data_dir, heads, policy, val_needed=not by_folds)
    else:
        splits = _csv_splits(data_cfg, data_dir, csvs, heads, policy)
    records, shared = _share_vocabularies([r for r, _ in splits], [v for _, v in splits], heads)
    where = ((os.path.join(data_dir, "train"), os.path.join(data_dir, "val")) if source == "folder"
             else tuple(os.path.join(data_dir, p) for p in csvs))
    _check_learnable(records, shared, heads, where, validation=not by_folds)
    labels = np.stack([r["labels"] for split in records for r in split])
    found = tuple(max(len(shared[h]), int(labels[:, i].max()) + 1) for i, h in enumerate(heads))
    records, names = _classification_folds(data_cfg, records, data_dir, process_index=process_index, workdir=workdir)
    out = [ExampleSource(r, loader=folder.DecodeClassification(), policy=policy, name=f"{source}/{s}")
           for r, s in zip(records, names)]
    return out[0], out[1], shared, found


def _class_folder_splits(data_dir: str, heads: tuple[str, ...], policy: BadFilePolicy,
                         val_needed: bool = True) -> list[tuple[list[dict], dict[str, list]]]:
    """(records, vocabularies) of ``data_dir/train`` and ``data_dir/val``, one folder per class; with
    ``val_needed`` False (folds of train/ validate) a missing val/ is an empty split."""
    from jaxrat.data.sources import folder

    if tuple(heads) != ("label",):
        raise ConfigError(f"config.task.heads={tuple(heads)}: a folder per class gives one head; "
                          f"use ('label',) or a CSV for several.")
    train_dir, val_dir = os.path.join(data_dir, "train"), os.path.join(data_dir, "val")
    if os.path.isdir(data_dir) and not os.path.isdir(train_dir):
        raise DataError(f"{data_dir} has no train/ folder; put one folder per class in {train_dir} (and in "
                        f"{val_dir} for validation).")
    train = folder.folder_records(train_dir, policy=policy)
    if not os.path.isdir(val_dir):
        if val_needed:
            raise DataError(f"{data_dir} has no val/ folder; add {val_dir} with a folder per class as in train/, "
                            f"or validate on folds of train/ with --config.data.folds=5.")
        val: tuple[list[dict], list[str]] = ([], [])
    else:
        val = folder.folder_records(val_dir, policy=policy, empty_classes=True)
    unknown = [c for c in val[1] if c not in train[1]]
    if unknown:
        near = {c.lower(): c for c in train[1]}
        hint = (f"rename it to {near[unknown[0].lower()]!r} as in train/" if unknown[0].lower() in near
                else "add its training images under train/, or remove it from val/")
        raise DataError(f"Class {unknown[0]!r} of {val_dir} has no folder in {train_dir} (whose classes are "
                        f"{', '.join(train[1][:8])}), so it cannot be learned; {hint}.")
    return [(records, {"label": classes}) for records, classes in (train, val)]


def _csv_splits(data_cfg: Any, data_dir: str, csvs: tuple[str, str], heads: tuple[str, ...],
                policy: BadFilePolicy) -> list[tuple[list[dict], dict[str, list]]]:
    """(records, vocabularies) of the train and validation CSVs (paths relative to ``data_dir``)."""
    from jaxrat.data.sources import folder

    column = _get(data_cfg, "image_column", "image")
    for field, name in zip(("train_csv", "val_csv"), csvs):
        if not os.path.isfile(os.path.join(data_dir, name)):
            raise DataError(f"CSV file {os.path.join(data_dir, name)} not found; write it there (an "
                            f"{column!r} column and one per head), point "
                            f"--config.data.{field} at yours (relative to data_dir), or, for one folder per "
                            f"class (DIR/train/<class>/*, DIR/val/<class>/*), set --config.data.source=folder.")
    return [folder.csv_records(os.path.join(data_dir, p), image_column=column, label_columns=heads,
                               image_root=data_dir, policy=policy) for p in csvs]


# Number labels may leave some classes unused (labels from 1 leave class 0 empty), but not most of a
# head: ids such as 1001, 2002 would give it thousands of classes that never occur.
MOST_UNUSED = 10


def _check_learnable(records: list[list[dict]], shared: dict[str, list], heads: tuple[str, ...],
                     where: tuple[str, str], *, validation: bool) -> None:
    """Refuse a head that cannot be trained as the labels ask: one class or none in the training split,
    or number labels that are ids rather than class indices; with ``validation``, warn of validation
    classes that the training split never shows."""
    train, val = records[0], records[1]
    for h, head in enumerate(heads):
        seen = sorted({int(r["labels"][h]) for r in train} - {-1})
        name = (lambda c: repr(str(shared[head][c]))) if shared[head] else str
        _say_near_duplicates(shared[head], head)
        if len(seen) < 2:
            found = f"one class ({name(seen[0])})" if seen else "no labels"
            raise DataError(f"Head {head!r} has {found} in the training split, so there is nothing to tell apart; "
                            f"label images of at least two classes in {where[0]}.")
        if not shared[head]:
            distinct = sorted(seen + [int(r["labels"][h]) for r in val if int(r["labels"][h]) >= 0])
            count = len(set(distinct))
            if distinct[-1] + 1 - count > max(count, MOST_UNUSED):
                raise DataError(f"Head {head!r} has number labels up to {distinct[-1]} but only {count} different "
                                f"ones, so it would get {distinct[-1] + 1} classes, most never seen; number the "
                                f"classes 0..{count - 1}, or write them as names (e.g. 'c{distinct[-1]}'), which are "
                                f"indexed in sorted order.")
        unseen = sorted({int(r["labels"][h]) for r in val} - set(seen) - {-1}) if validation else []
        if unseen:
            # Said, not refused: its images still count in the validation metrics (as misses), which
            # is what a held-out split with a class the training split lacks measures.
            n = sum(int(r["labels"][h]) in unseen for r in val)
            logging.warning("data: class(es) %s of head %r are in %s but not in %s, so they cannot be learned and "
                            "their %d validation image(s) count as wrong; add training images of them, or remove "
                            "them from the validation split.", ", ".join(name(c) for c in unseen), head, where[1],
                            where[0], n)


def _say_near_duplicates(names: list, head: str) -> None:
    """Warn of class names that differ only in case or spaces ('Cat' and 'cat'): kept apart as written
    (they may be meant), but more often one class typed two ways, which splits its images."""
    by_key: dict[str, list[str]] = {}
    for name in map(str, names):
        by_key.setdefault(" ".join(name.lower().split()), []).append(name)
    pairs = [group for group in by_key.values() if len(group) > 1]
    if pairs:
        logging.warning("data: head %r has classes that differ only in case or spaces: %s; they are separate "
                        "classes, so if each is one class typed two ways, write it one way in the labels.", head,
                        "; ".join(" and ".join(repr(n) for n in group) for group in pairs[:5]))


def _classification_folds(data_cfg: Any, records: list[list[dict]], data_dir: str, *, process_index: int,
                          workdir: str) -> tuple[list[list[dict]], tuple[str, str]]:
    """The (train, validation) records and their names: the two splits, or with ``data.folds`` a fold
    of the training split held out."""
    train = records[0]
    ids = [os.path.relpath(str(r["path"]), data_dir) for r in train]
    # Stratified by the first head's class: each fold holds its classes in the training split's proportions.
    parts = folds.split(train, ids, data_cfg, classes=[int(r["labels"][0]) for r in train],
                        process_index=process_index, workdir=workdir)
    if parts is None:
        return records, ("train", "validation")
    k, fold = folds.settings(data_cfg)[:2]
    return list(parts), (f"train-fold{fold}of{k}", f"fold{fold}of{k}")


def _share_vocabularies(records: list[list[dict]], vocabs: list[dict[str, list]],
                        heads: tuple[str, ...]) -> tuple[list[list[dict]], dict[str, list]]:
    """Relabel every split against the sorted union of the splits' text vocabularies."""
    shared = {h: sorted(set().union(*(v.get(h) or [] for v in vocabs))) for h in heads}
    out = []
    for split, vocab in zip(records, vocabs):
        maps = [{i: shared[h].index(name) for i, name in enumerate(vocab.get(h) or [])} for h in heads]
        relabelled = []
        for r in split:
            labels = np.array([m.get(int(v), int(v)) if m and v >= 0 else int(v) for m, v in zip(maps, r["labels"])],
                              np.int32)
            relabelled.append({**r, "labels": labels})
        out.append(relabelled)
    return out, shared
