"""Evaluation text: the bundled novel by default, or a local file."""

from __future__ import annotations

import gzip
from pathlib import Path

from quant.calibration import read_text_file

DATA = Path(__file__).parent / "data"
DEFAULT_TEXT = "persuasion.txt"  # Jane Austen, Persuasion (1818): public domain, never used for calibration


def load_text(spec: str = "default") -> str:
    """``default`` (the bundled Persuasion), a ``.txt`` file, or a ``.jsonl`` file with a ``text`` field."""
    if spec == "default":
        return gzip.decompress((DATA / f"{DEFAULT_TEXT}.gz").read_bytes()).decode("utf-8")
    return read_text_file(spec)
