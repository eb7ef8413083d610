"""lowbit: quantize LLMs into compressed-tensors checkpoints, run them, measure them."""

from evals.provenance import lowbit_version

__version__ = lowbit_version()  # one source of truth: pyproject.toml, through the installed metadata
