"""Quantize a model straight to a GGUF file: llama.cpp's mix decides each tensor's type
(``quant.gguf_mix``), lowbit's methods round each Linear onto its type's fitted grid
(``quant.gguf_fit``) through the ordinary calibration pipeline (``quant.quantize``), and the
GGUF writer (``quant.gguf.write``) stores the fields.

Methods on GGUF grids: ``rtn`` (nearest rounding on a grid searched without data), ``gptq`` (grid
searched with the calibration inputs' diag(H), codes by GPTQ), ``awq`` (its scale and clipping
searches score the type's own quantizer: ``quant.awq``; then rtn, gptq or signround round) and
``signround`` (offsets and sub-block scales learnt through the type's dequantization:
``quant.gguf_signround``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quant.architectures import decoder_config
from quant.gguf_mix import GridScheme, check_mix, tensor_types

METHODS = ("rtn", "gptq", "awq", "signround")  # the methods that know a GGUF type's grid


def check_methods(methods, mix: str = "GGUF") -> None:
    """A ValueError naming the methods a GGUF target cannot take and the type."""
    from quant.methods import parse_names

    others = [m for m in parse_names(methods) if m not in METHODS]
    if others:
        raise ValueError(f"{', '.join(others)} cannot round onto {mix}'s grid: a GGUF target takes "
                         f"methods {', '.join(METHODS)}")


# recipe keys a GGUF target replaces: the mix decides every tensor's type and grid
REPLACED_KEYS = ("bits", "group_size", "symmetric", "overrides", "target_bits", "candidates")


def check_target(mix: str, methods: list[str], weights_keys=()) -> str:
    """A recipe's ``gguf:`` target, checked before any work: the mix (its name normalized), the
    methods, and no weight keys the mix would silently override (ValueError naming the problem)."""
    mix = check_mix(mix)
    check_methods(methods, mix)
    replaced = [k for k in REPLACED_KEYS if k in weights_keys]
    if replaced:
        raise ValueError(f"weights.{', weights.'.join(replaced)} do not apply to a GGUF target: llama.cpp's {mix} "
                         f"mix sets every tensor's type; remove them (or drop gguf: for a lowbit checkpoint)")
    return mix


def plan_types(model: torch.nn.Module, mix: str, calibrated: bool) -> dict[str, str]:
    """Each 2-D weight's GGUF type under ``mix`` (module name -> type), as llama-quantize picks it."""
    text = decoder_config(model.config.to_dict())
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    heads, kv_heads = text["num_attention_heads"], text.get("num_key_value_heads") or text["num_attention_heads"]
    return tensor_types(shapes, mix, text["num_hidden_layers"], heads // kv_heads,
                        bool(text.get("tie_word_embeddings", False)), has_imatrix=calibrated)


def quantize_gguf(model: torch.nn.Module, mix: str, methods: list[str], *, samples=None, settings=None,
                  device: str = "cpu", progress: bool = True, lazy=None) -> tuple[dict, dict]:
    """The GGUF fields of every weight the mix quantizes (Hugging Face tensor name -> GGUFFields),
    the decoder layers' 1-D tensors as the methods left them (float), and the pipeline's per-Linear
    stats. Linears inside the decoder layers go through the calibration pipeline; the embedding and
    head (no calibration statistics) are rounded to nearest on their searched grid, as llama-quantize
    does (its Q8_0/Q6_K take no imatrix there
    for a tied embedding)."""
    from quant import gguf_fit
    from quant.quantize import quantize_model

    mix = check_mix(mix)
    check_methods(methods, mix)
    types = plan_types(model, mix, samples is not None)
    linears = {n: GridScheme(t) for n, t in types.items() if isinstance(model.get_submodule(n), torch.nn.Linear)
               and ".layers." in n}
    quantized, stats = quantize_model(model, linears, methods, samples=samples, device=device, progress=progress,
                                      lazy=lazy, **(settings or {}))
    fields = {f"{n}.weight": q.fields for n, q in quantized.items()}
    # norms and biases inside the decoder layers as the layer steps left them (AWQ folds 1/s into
    # them): the file must hold these, not the source's
    fields.update({n: p.detach() for n, p in model.named_parameters()
                   if p.dim() == 1 and ".layers." in n and not p.is_meta})
    for n, t in types.items():
        if n not in linears and not (n.endswith("lm_head") and model.config.tie_word_embeddings):
            weight = model.get_submodule(n).weight.detach()
            fields[f"{n}.weight"] = gguf_fit.round_to_nearest(weight, t).fields
            stats[n] = {"scheme": f"gguf {t}"}
    return fields, stats


def quantize_to_file(model: str, mix: str, methods: list[str], settings: dict, calibration, output: Path,
                     overwrite: bool = False, device: str = "cpu", progress: bool = True) -> Path:
    """A recipe's GGUF target end to end: resolve the model, draw the calibration windows if a
    method reads data (``calibration``: text, samples, seq_len, seed, bos), quantize, write."""
    from quant import methods as registry
    from quant import models
    from quant.calibration import calibration_samples, load_calibration_text

    source = models.resolve(model)
    calibrated = any(m.needs_data for m in registry.chain(methods))
    loaded = models.load_lazily(source) if calibrated else None
    model_, tokenizer, lazy = loaded or (*models.load_float_model(source), None)
    samples = None
    if calibrated:
        c = calibration
        samples = calibration_samples(tokenizer, load_calibration_text(c.text), c.samples, c.seq_len, c.seed, c.bos)
    fields, _ = quantize_gguf(model_, mix, methods, samples=samples, settings=settings, device=device,
                              progress=progress, lazy=lazy)
    write(Path(output), source, fields, overwrite=overwrite)
    return Path(output)


def source_tensors(source: Path):
    """(name, float tensor) for every tensor of the float model at ``source``, in file order."""
    from safetensors import safe_open

    from quant.models import safetensors_index

    for name, path in safetensors_index(Path(source)).items():
        with safe_open(str(path), framework="pt") as f:
            yield name, f.get_tensor(name)


def write(out: Path, source: Path, fields: dict, overwrite: bool = False) -> dict[str, str]:
    """The GGUF file at ``out``: the fitted tensors from ``fields``, every other tensor of the float
    model at ``source`` as it is (norms in float32, as llama.cpp keeps them)."""
    from quant.gguf.write import write_gguf

    config = json.loads((Path(source) / "config.json").read_text())
    weights = ((n, fields.get(n, t)) for n, t in source_tensors(source))
    return write_gguf(out, config, Path(source), weights, name=Path(source).name, overwrite=overwrite)
