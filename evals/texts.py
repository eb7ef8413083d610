"""Evaluation text: the bundled novel by default, or a local file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
DEFAULT_TEXT = "persuasion.txt"  # Jane Austen, Persuasion (1818): public domain, never used for calibration


def load_text(spec: str = "default") -> str:
    """``default`` (the bundled Persuasion), a ``.txt`` file, or a ``.jsonl`` file with a ``text`` field."""
    if spec == "default":
        return gzip.decompress((DATA / f"{DEFAULT_TEXT}.gz").read_bytes()).decode("utf-8")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} not found; pass 'default' or a .txt/.jsonl path")
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if any("text" not in r for r in rows):
            raise ValueError(f"{path}: every JSON line needs a 'text' field")
        text = "\n\n".join(r["text"] for r in rows)
    else:
        text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path} holds no text")
    return text
