"""Commit the last whole run's seconds per test file as the hand-out order of a fresh clone.

``bash scripts/test.sh`` keeps each file's seconds in pytest's cache (``.pytest_cache``, not committed),
so a clone that has never run the suite (CI) would hand files out by tier alone, and a long file
could start last. After a whole run on the 2-core machine::

    python scripts/save_test_times.py      # writes tests/file_seconds.json from the cache

Files the cache lacks keep their committed time; files that no longer exist are dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".pytest_cache" / "v" / "jaxrat" / "file_seconds"
SEED = REPO / "tests" / "file_seconds.json"


def merged(cache: dict[str, float], seed: dict[str, float], tests: Path) -> dict[str, float]:
    """``seed`` updated by ``cache``, keeping only files that exist under ``tests``, longest first."""
    both = {**seed, **cache}
    kept = {k: round(float(v), 1) for k, v in both.items() if (tests / k).is_file()}
    return dict(sorted(kept.items(), key=lambda kv: (-kv[1], kv[0])))


def main() -> int:
    if not CACHE.is_file():
        print(f"no test times in {CACHE}: run `bash scripts/test.sh` first.", file=sys.stderr)
        return 1
    seed = json.loads(SEED.read_text()) if SEED.is_file() else {}
    times = merged(json.loads(CACHE.read_text()), seed, REPO / "tests")
    SEED.write_text(json.dumps(times, indent=1) + "\n")
    print(f"wrote {SEED.relative_to(REPO)}: {len(times)} files, {sum(times.values()) / 60:.0f} min of tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
