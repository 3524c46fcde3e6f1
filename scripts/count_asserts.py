"""Count the assertions in the test suite: ``assert`` statements, ``pytest.raises``/``pytest.warns`` calls
and calls of ``assert_*`` functions (``np.testing.assert_allclose``, ``runner.assert_same_losses``).

Moving, merging or reshaping tests must not lower the total (issue 56): run this before and after and
compare. Assertions in helpers (``runner.assert_same_losses``, a module's ``_check``) count once, where
they are written, like those in the tests themselves::

    python scripts/count_asserts.py               # the total
    python scripts/count_asserts.py --per-test    # one line per test function, then the total
    python scripts/count_asserts.py --per-file    # one line per file, then the total
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
_CHECKS = {"raises", "warns"}


def _is_check(node: ast.AST) -> bool:
    """``assert ...``, ``pytest.raises(...)``/``pytest.warns(...)``, or a call of any ``assert_*``."""
    if isinstance(node, ast.Assert):
        return True
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name.startswith("assert_"):
        return True
    if name in _CHECKS:
        return not isinstance(func, ast.Attribute) or getattr(func.value, "id", "") == "pytest"
    return False


def count_file(path: Path) -> dict[str, int]:
    """Assertions per top-level function or class in ``path`` (``<module>`` for the rest)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    counts: dict[str, int] = {}
    for node in tree.body:
        name = getattr(node, "name", "<module>")
        found = sum(_is_check(inner) for inner in ast.walk(node))
        if found or name.startswith("test"):
            counts[name] = counts.get(name, 0) + found
    return counts


def count_tree(root: Path = TESTS) -> dict[Path, dict[str, int]]:
    """Per file under ``root`` (every ``.py``, helpers included), its assertions per function."""
    return {path: count_file(path) for path in sorted(root.rglob("*.py"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-test", action="store_true", help="one line per test function")
    parser.add_argument("--per-file", action="store_true", help="one line per file")
    parser.add_argument("--root", type=Path, default=TESTS, help="the tests folder (default: this clone's)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"{args.root} is not a folder; pass --root the tests folder")
    tree = count_tree(args.root)
    for path, counts in tree.items():
        where = path.relative_to(args.root)
        if args.per_file:
            print(f"{sum(counts.values()):6d}  {where}")
        if args.per_test:
            for name, found in counts.items():
                print(f"{found:6d}  {where}::{name}")
    tests = sum(name.startswith("test") for counts in tree.values() for name in counts)
    print(f"{sum(sum(c.values()) for c in tree.values())} assertions in {len(tree)} files ({tests} test functions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
