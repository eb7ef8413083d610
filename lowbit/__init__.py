"""lowbit: quantize LLMs into compressed-tensors checkpoints, run them, measure them."""


def __getattr__(name: str):
    # read on demand: importing lowbit must not import torch, so that the command line can set
    # OpenMP's defaults before torch loads it (lowbit/cli.py)
    if name == "__version__":
        from evals.provenance import lowbit_version

        return lowbit_version()  # one source of truth: pyproject.toml, through the installed metadata
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
