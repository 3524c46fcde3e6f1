"""Convert ISIC 2018 Task 1 from its official folders to ArrayRecord, once:

    python -m jaxrat.data.prepare_isic --src ISIC_DIR --out TFDS_DIR [--max-side 1024]
        [--split-file F] [--on-bad-file skip]

then train with ``--config.data.source=tfds --config.data.data_dir=TFDS_DIR``. ``--src`` is only
read; under ``--on-bad-file skip`` the files left out are listed in ``TFDS_DIR/skipped_files.txt``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxrat.data.sources import isic_arrayrecord
from jaxrat.runtime.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """User errors print one sentence and exit 2."""
    p = argparse.ArgumentParser(prog=isic_arrayrecord.CLI, description="Convert ISIC 2018 to ArrayRecord.")
    p.add_argument("--src", required=True, help="folder with the official ISIC 2018 folders (only read)")
    p.add_argument("--out", required=True, help="TFDS data_dir to write (config.data.data_dir with source=tfds)")
    p.add_argument("--split-file", default="")
    p.add_argument("--on-bad-file", default="fail", choices=("fail", "skip"))
    p.add_argument("--max-side", type=int, default=0,
                   help="store images shrunk to this longer side (e.g. 1024 for 256 px training); 0: as they are")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        isic_arrayrecord.prepare(args.src, args.out, split_file=args.split_file, on_bad_file=args.on_bad_file,
                                 max_side=args.max_side)
    except UserError as e:
        # Messages written for training name the config key; this command's switch is --on-bad-file.
        message = str(e).replace("--config.data.on_bad_file=skip", "--on-bad-file=skip")
        print(f"jaxrat: error: {message}", file=sys.stderr)
        return 2
    print(f"{isic_arrayrecord.NAME} written as ArrayRecord under {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
