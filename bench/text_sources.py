"""Rebuild the bundled texts that are not Austen: the code and documentation parts of the mixed
calibration source (``quant/data/calibration-{code,docs}.txt.gz``, read by
``quant.calibration.load_calibration_text("mixed")``) and the documentation evaluation text
(``evals/data/docs.txt.gz``, ``evals.texts.load_text("docs")``).

    python -m bench.text_sources

Needs CPython 3.11.7 (the bundled files are its sources, byte for byte) and the packages whose
READMEs make the evaluation text installed (lowbit's test environment). What goes where:

* calibration code: CPython 3.11.7 ``Lib/`` modules (PSF License) listed in :data:`CODE_MODULES`;
  never ``argparse.py``, the bundled code evaluation text;
* calibration docs: the Python reference's topic texts that ``help()`` prints
  (``pydoc_data/topics.py``, PSF License), plain-text reStructuredText;
* evaluation docs: the Markdown READMEs (PyPI long descriptions) of the packages in
  :data:`DOC_PACKAGES`, each under its own permissive license (named in ``evals/texts.py``):
  another source than the calibration docs, so the score says whether a method fits technical
  documentation or only the Python reference.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_MODULES = ("dataclasses.py", "enum.py", "functools.py", "pathlib.py", "shutil.py", "textwrap.py", "csv.py",
                "heapq.py", "statistics.py", "configparser.py", "string.py", "json/decoder.py", "json/encoder.py",
                "logging/__init__.py", "http/client.py", "tarfile.py", "difflib.py", "fractions.py")
DOC_PACKAGES = ("torch", "transformers", "rich", "typer", "accelerate", "huggingface_hub", "numpy", "threadpoolctl")
CHARS = 450_000  # per calibration part: about the Python reference's length, the shortest of the three


def code_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((lib / m).read_text(encoding="utf-8") for m in CODE_MODULES)
    return text[:text.rfind("\n", 0, CHARS) + 1]


def docs_text() -> str:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[:text.rfind("\n", 0, CHARS) + 1]


def readmes() -> str:
    parts = []
    for name in DOC_PACKAGES:
        meta = importlib.metadata.metadata(name)
        if "markdown" not in (meta.get("Description-Content-Type") or ""):
            raise SystemExit(f"{name}'s long description is not Markdown")
        parts.append(meta.get_payload().strip())
    return "\n\n".join(parts) + "\n"


def write(path: Path, text: str) -> None:
    path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    print(f"{path.relative_to(ROOT)}: {len(text):,} characters")


def main():
    if sys.version_info[:3] != (3, 11, 7):
        raise SystemExit(f"the bundled texts are CPython 3.11.7's; this is {sys.version.split()[0]}")
    write(ROOT / "quant" / "data" / "calibration-code.txt.gz", code_text())
    write(ROOT / "quant" / "data" / "calibration-docs.txt.gz", docs_text())
    write(ROOT / "evals" / "data" / "docs.txt.gz", readmes())


if __name__ == "__main__":
    main()
