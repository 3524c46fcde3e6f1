"""Download a pretrained model folder from the Hugging Face hub: resumable, cached, no pickle first.

    python -m jaxrat.data.hub timm/beit_base_patch16_224.in22k_ft_in22k_in1k --dest ~/weights
    python -m jaxrat.data.hub microsoft/beit-base-patch16-224 --dest ~/weights --revision main

writes ``DEST/<owner>--<name>/`` with ``config.json`` and the weights, ready for
``--config.model.pretrained=DEST/<owner>--<name>``. The weights are ``model.safetensors`` when the
repository has it (tensors only), else ``pytorch_model.bin`` (read later only with
``torch.load(weights_only=True)``). Files already there are kept (the cache); an interrupted
download resumes from its ``.part`` file with an HTTP Range request (:func:`jaxrat.data.download.fetch`).
``--endpoint`` (default ``$HF_ENDPOINT`` or https://huggingface.co) points at a mirror. Gated or
private repositories need a token, which this command does not send: download those with
``huggingface-cli download`` and point ``pretrained`` at the folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import urllib.parse

from jaxrat.data.download import fetch
from jaxrat.runtime.errors import DataError, UserError

WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def folder_for(repo_id: str, dest: str) -> str:
    """Where ``repo_id`` lands under ``dest`` (the hub cache's ``owner--name`` spelling)."""
    return os.path.join(os.path.expanduser(dest), repo_id.replace("/", "--"))


def download_model(repo_id: str, dest: str, *, revision: str = "main", endpoint: str | None = None,
                   retries: int = 5, timeout: float = 60.0) -> str:
    """Fetch ``config.json`` and the first of :data:`WEIGHTS` the repository has; returns the folder."""
    if repo_id.count("/") != 1 or repo_id.startswith("/") or ".." in repo_id:
        raise UserError(f"{repo_id!r} is not a hub repository id; write OWNER/NAME, e.g. "
                        f"timm/vit_base_patch16_224.augreg2_in21k_ft_in1k.")
    base = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    folder = folder_for(repo_id, dest)
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        return _fetch_model(repo_id, folder, base, revision, retries, timeout)
    except BaseException:
        # A first download that failed leaves no folder that looks like a model (empty, or a
        # config.json without weights); one holding a partial weights file stays, to resume from.
        if created and not _resumable(folder):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _resumable(folder: str) -> bool:
    return any(n.endswith(".part") and os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def _fetch_model(repo_id: str, folder: str, base: str, revision: str, retries: int, timeout: float) -> str:

    def get(name: str) -> None:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            logging.info("%s: %s already downloaded", repo_id, name)
            return
        url = f"{base}/{repo_id}/resolve/{urllib.parse.quote(revision, safe='')}/{name}"
        fetch(url, path, retries=retries, timeout=timeout, mirror_flag="--endpoint")

    get("config.json")
    missing = []
    for name in WEIGHTS:
        try:
            get(name)
            return folder
        except DataError as e:
            if "HTTP 404" not in str(e):
                raise
            missing.append(name)
    raise DataError(f"{repo_id} at {revision} has none of {', '.join(missing)} on {base}; check the repository "
                    f"id, or download its weights yourself and point pretrained at them.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxrat.data.hub", description=__doc__.split("\n\n")[0])
    p.add_argument("repo_id", help="OWNER/NAME on the hub")
    p.add_argument("--dest", required=True, help="folder for the model folders")
    p.add_argument("--revision", default="main")
    p.add_argument("--endpoint", default=None, help="hub URL (default $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--retries", type=int, default=5)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = download_model(a.repo_id, a.dest, revision=a.revision, endpoint=a.endpoint, retries=a.retries)
    except UserError as e:
        print(f"jaxrat: error: {e}", file=sys.stderr)
        return 2
    print(f"--config.model.pretrained={folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
