"""``runtime.load``: a checkpoint directory (or alias) to a model that gives logits and streams tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from quant import checkpoint, models
from quant.affine import QuantScheme
from runtime.generate import Generation, check_sampling
from runtime.linear import QuantLinear
from runtime.model import Decoder, DecoderConfig, plain_linear


def linear_factory(schemes: dict[str, QuantScheme]):
    def make_linear(name: str, in_features: int, out_features: int, bias: bool):
        if name in schemes:
            return QuantLinear(in_features, out_features, schemes[name], bias)
        return plain_linear(name, in_features, out_features, bias)

    return make_linear


def linear_names(cfg: DecoderConfig) -> list[str]:
    """Every Linear's name, known from the config alone (no weights needed)."""
    with torch.device("meta"):
        return [n for n, m in Decoder(cfg).named_modules() if isinstance(m, torch.nn.Linear)]


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.resolve(path), trust_remote_code=False)


class Model:
    """A loaded checkpoint: ``logits`` for evaluation, ``generate`` for streaming text."""

    def __init__(self, decoder: Decoder, config: dict, tokenizer, device: torch.device, dtype: torch.dtype, path: Path):
        self.decoder, self.config, self.tokenizer = decoder, config, tokenizer
        self.device, self.dtype, self.path = device, dtype, path
        self.max_positions = decoder.cfg.max_positions
        eos = config.get("eos_token_id")
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @property
    def num_parameters(self) -> int:
        total = 0
        for m in self.decoder.modules():
            if isinstance(m, QuantLinear):
                total += m.in_features * m.out_features
            else:
                total += sum(p.numel() for p in m.parameters(recurse=False))
        return total

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, V] for token ids [B, T] (no cache)."""
        return self.decoder(input_ids.to(self.device)).float()

    def generate(self, prompt: str | list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True) -> Generation:
        check_sampling(max_new_tokens, temperature, top_p)
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_positions:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_positions}")
        return Generation(self, ids, max_new_tokens, temperature, top_p, seed, stop_at_eos)


def default_dtype(device: torch.device, config: dict) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32  # bf16/fp16 matmuls are slow on CPUs
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name, torch.bfloat16)


def load(path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Model:
    """Load a Hugging Face directory, a lowbit/compressed-tensors checkpoint, or an alias."""
    path = models.resolve(path)
    checkpoint.verify(path)  # a manifest, when present, must match every file
    config = checkpoint.read_config(path)
    cfg = DecoderConfig.from_hf(config)
    device = torch.device(device)
    dtype = dtype or default_dtype(device, config)
    schemes = checkpoint.read_schemes(path, linear_names(cfg))

    with torch.device("meta"):
        decoder = Decoder(cfg, linear_factory(schemes))
    tensors = checkpoint.read_tensors(path)
    if cfg.tie_embeddings and "lm_head" not in schemes:
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    expected = set(decoder.state_dict())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise checkpoint.CheckpointError(
            f"{path}: tensors do not match a {config.get('model_type')} model with this config; "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    state = {k: (t.to(dtype) if t.is_floating_point() and not k.endswith("weight_scale") else t) for k, t in tensors.items()}
    decoder.load_state_dict(state, assign=True)
    if cfg.tie_embeddings and "lm_head" not in schemes:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    decoder.to(device).eval()
    for module in decoder.modules():
        if isinstance(module, QuantLinear):
            module.materialize(dtype)  # at load, so the first request does not pay for it
    return Model(decoder, config, load_tokenizer(path), device, dtype, path)
