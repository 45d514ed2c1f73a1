"""The house's size rule, checked by ``make lint``: no module in ``fastvision/`` over 400 lines and no
function over 60 (from its ``def`` line to its last line, docstring included).

Usage: ``python scripts/check_sizes.py [ROOT]`` (default ``fastvision``). Prints one line per breach,
``path:line: name is N lines (limit 60)``, and exits 1 if there is any, 0 otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def breaches(root: Path) -> list[str]:
    """Every file and function of the ``*.py`` files under ``root`` that is over its limit, sorted by path."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path}: {lines} lines (limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno}: {node.name} is {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "fastvision")
    if not root.is_dir():
        print(f"check_sizes: {root} is not a folder", file=sys.stderr)
        return 2
    found = breaches(root)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
