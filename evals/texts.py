"""Evaluation texts: bundled ones by name, or a local file.

* ``default`` / ``persuasion``: Jane Austen, *Persuasion* (1818), public domain,
  never used for calibration (the calibration text is five other Austen novels).
* ``code``: CPython 3.11.7's ``Lib/argparse.py`` (PSF License), Python source: a
  genre the calibration text has nothing like, to check that a method did not
  just fit the calibration domain.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from quant.calibration import read_text_file

DATA = Path(__file__).parent / "data"
BUNDLED = {"default": "persuasion.txt.gz", "persuasion": "persuasion.txt.gz", "code": "code.txt.gz"}


def load_text(spec: str = "default") -> str:
    """A bundled text by name (``default``, ``persuasion``, ``code``), a ``.txt`` file, or a
    ``.jsonl`` file with a ``text`` field per line."""
    if spec in BUNDLED:
        return gzip.decompress((DATA / BUNDLED[spec]).read_bytes()).decode("utf-8")
    return read_text_file(spec)
