"""Evaluation texts: bundled ones by name, or a local file.

* ``default`` / ``persuasion``: Jane Austen, *Persuasion* (1818), public domain,
  never used for calibration (the calibration text is five other Austen novels).
* ``code``: CPython 3.11.7's ``Lib/argparse.py`` (PSF License), Python source: a
  genre the calibration text has nothing like, to check that a method did not
  just fit the calibration domain.
* ``docs``: technical documentation in Markdown, the PyPI READMEs of torch 2.13.0 (BSD-3-Clause
  and others), transformers 5.24.0 (Apache-2.0), rich 15.0.0 (MIT), typer 0.29.2 (MIT),
  accelerate 1.15.0 (Apache-2.0), huggingface_hub 2.4.0 (Apache-2.0), numpy 2.4.6 (BSD-3-Clause
  and others) and threadpoolctl 3.8.0 (BSD-3-Clause), each under its package's license; another
  source than the ``mixed`` calibration text's documentation part (the Python reference).
"""

from __future__ import annotations

import gzip
from pathlib import Path

from quant.calibration import read_text_file

DATA = Path(__file__).parent / "data"
BUNDLED = {"default": "persuasion.txt.gz", "persuasion": "persuasion.txt.gz", "code": "code.txt.gz", "docs": "docs.txt.gz"}


def load_text(spec: str = "default") -> str:
    """A bundled text by name (``default``, ``persuasion``, ``code``, ``docs``), a ``.txt`` file, or a
    ``.jsonl`` file with a ``text`` field per line."""
    if spec in BUNDLED:
        return gzip.decompress((DATA / BUNDLED[spec]).read_bytes()).decode("utf-8")
    return read_text_file(spec)
