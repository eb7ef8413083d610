"""Calibration data: token windows sampled reproducibly from a text.

The default text is the bundled copy of five Austen novels (Emma, Mansfield
Park, Northanger Abbey, Pride and Prejudice, Sense and Sensibility); the
evaluation text, Persuasion, is never among them. ``mixed`` is three genres in equal parts of
450,000 characters each, so that a method is not fitted to one genre: the start of that Austen text
(prose), CPython 3.11.7 ``Lib/`` modules other than ``argparse.py`` (code; the bundled code
evaluation text is argparse.py) and the Python reference's topic texts from ``pydoc_data`` (technical
documentation), joined in that order; windows are drawn from the whole, so about a third of them
from each part. ``bench/text_sources.py`` rebuilds the code and documentation files.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

DEFAULT_TEXT = Path(__file__).parent / "data" / "calibration.txt.gz"
MIXED_PARTS = ("calibration-code.txt.gz", "calibration-docs.txt.gz")  # after the prose part


def _json_line(path: Path, number: int, line: str):
    try:
        return json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}: line {number} is not JSON ({e}); a .jsonl file holds one JSON object "
                         "with a 'text' field per line") from None


def read_text_file(path) -> str:
    """A ``.txt`` file, or a ``.jsonl`` file whose lines each have a ``text`` field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} not found; pass 'default' or a .txt/.jsonl path")
    try:
        if path.suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            rows = [_json_line(path, i + 1, line) for i, line in enumerate(lines) if line.strip()]
            if any(not isinstance(r, dict) or not isinstance(r.get("text"), str) for r in rows):
                raise ValueError(f"{path}: every JSON line needs a 'text' field holding a string")
            text = "\n\n".join(r["text"] for r in rows)
        else:
            text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a binary file: say which, not only the codec's complaint
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); give a .txt or .jsonl "
                         "file of text") from None
    if not text.strip():
        raise ValueError(f"{path} holds no text")
    return text


def load_calibration_text(spec: str = "default") -> str:
    """``default`` (Austen), ``mixed`` (prose, code, documentation), a local .txt/.jsonl path, or a
    Hugging Face ``datasets`` name (its ``text`` column)."""
    if spec == "default":
        return gzip.decompress(DEFAULT_TEXT.read_bytes()).decode("utf-8")
    if spec == "mixed":
        return mixed_text()
    if Path(spec).expanduser().exists() or spec.endswith((".txt", ".jsonl")):
        return read_text_file(spec)
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"calibration text {spec!r} is not a file, and the datasets package is not installed") from None
    try:
        ds = datasets.load_dataset(spec, split="train")
    except Exception as e:
        raise FileNotFoundError(
            f"could not load the dataset {spec!r} ({type(e).__name__}); offline, use 'default', 'mixed' or a local .txt/.jsonl"
        ) from e
    if "text" not in ds.column_names:
        raise ValueError(f"dataset {spec!r} has no 'text' column (columns: {', '.join(ds.column_names)})")
    return "\n\n".join(ds["text"])


def mixed_text() -> str:
    """The ``mixed`` source: as much Austen prose as each other part holds, then code, then docs."""
    parts = [gzip.decompress((DEFAULT_TEXT.parent / name).read_bytes()).decode("utf-8") for name in MIXED_PARTS]
    prose = load_calibration_text("default")
    prose = prose[:prose.rfind("\n", 0, min(map(len, parts))) + 1]
    return "\n\n".join([prose, *parts])


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer begins an encoded prompt with its BOS token."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    return bos_id is not None and tokenizer("a").input_ids[:1] == [bos_id]


def calibration_samples(
    tokenizer, text: str, samples: int, seq_len: int, seed: int = 0, bos: bool | None = None
) -> torch.Tensor:
    """``samples`` distinct windows of ``seq_len`` tokens, chosen by ``seed``: LongTensor [samples, seq_len].

    With ``bos`` each window is the tokenizer's BOS and ``seq_len - 1`` tokens of text, formatted as the
    model sees a prompt (the first position carries outsized activations). ``None`` (the default) does
    what the tokenizer does when it encodes a prompt: BOS where it adds one (Llama), none where it does
    not (SmolLM2; forcing one there changed nothing measurable, bench/results/quality/gptq-factors-w4-bos.json).
    """
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is None:
        raise ValueError("calibration.bos is true but the tokenizer has no BOS token; set calibration.bos: false")
    use_bos = adds_bos(tokenizer) if bos is None else bos
    prefix = [bos_id] if use_bos else []
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"calibration.seq_len {seq_len} leaves no room for text after the BOS; use 2 or more")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)
    windows = ids.numel() // body
    if windows < samples:
        raise ValueError(
            f"calibration needs {samples} x {seq_len} = {samples * seq_len} tokens, but the text has "
            f"{ids.numel()}; give a longer text or lower calibration.samples / calibration.seq_len"
        )
    chosen = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:samples].sort().values
    picked = ids[: windows * body].view(windows, body)[chosen]
    return torch.cat([torch.tensor(prefix, dtype=torch.long).expand(samples, len(prefix)), picked], 1)
