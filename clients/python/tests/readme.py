"""The code blocks of clients/python/README.md that tests run as written: each between
`<!-- BEGIN name ... -->` and `<!-- END name -->`, one fenced block."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str) -> str:
    """The code of the README's fenced block marked `name`; `LookupError` when there is none,
    or more than one."""
    pattern = (
        rf"<!-- BEGIN {re.escape(name)}\b[^>]*-->\s*```[a-z]*\n(.*?)```\s*"
        rf"<!-- END {re.escape(name)} -->"
    )
    found = re.findall(pattern, README.read_text(), re.S)
    if len(found) != 1:
        raise LookupError(f"{README} has {len(found)} blocks marked {name!r}, not one")
    return found[0]
