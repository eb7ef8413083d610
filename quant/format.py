"""The compressed-tensors ``pack-quantized`` format: tensor names and the config block.

A quantized Linear ``name`` is stored as

* ``name.weight_packed``     int32 ``[out, ceil(in * bits / 32)]``, packed along inputs;
* ``name.weight_scale``      float ``[out, in // group]`` (``[out, 1]`` per channel);
* ``name.weight_zero_point`` int32 ``[ceil(out * bits / 32), in // group]``, packed along
  outputs, asymmetric schemes only;
* ``name.weight_shape``      int64 ``[out, in]``;
* ``name.weight_g_idx``      int32 ``[in]``, each input column's group, only for GPTQ
  act-order with ``actorder: group``.

This is what llm-compressor writes and vLLM and transformers read. Layouts for
fast kernels are derived from it at load time in ``runtime/``, never stored.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from quant.affine import QuantScheme, dequantize
from quant.packing import pack, packed_length, unpack
from quant.moe import EXPERT_LINEAR
from quant.plan import matches

FORMAT = "pack-quantized"
TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass
class QuantizedWeight:
    """A weight on its integer grid: ``weight ≈ (q - zero) * scale`` per group."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out, groups]
    zero: torch.Tensor | None  # int8 [out, groups], None when symmetric
    scheme: QuantScheme
    g_idx: torch.Tensor | None = None  # int32 [in], only when scheme.actorder == "group"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero, self.scheme, dtype, self.g_idx)

    def to_tensors(self, prefix: str, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        bits = self.scheme.bits
        tensors = {
            f"{prefix}.weight_packed": pack(self.q, bits, dim=1),
            f"{prefix}.weight_scale": self.scale.to(scale_dtype).contiguous(),
            f"{prefix}.weight_shape": torch.tensor(self.q.shape, dtype=torch.int64),
        }
        if self.zero is not None:
            tensors[f"{prefix}.weight_zero_point"] = pack(self.zero, bits, dim=0)
        if self.g_idx is not None:
            tensors[f"{prefix}.weight_g_idx"] = self.g_idx.to(torch.int32).contiguous()
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> "QuantizedWeight":
        out, inp = (int(v) for v in tensors[f"{prefix}.weight_shape"])
        q = unpack(tensors[f"{prefix}.weight_packed"], scheme.bits, inp, dim=1)
        zp = tensors.get(f"{prefix}.weight_zero_point")
        zero = None if scheme.symmetric else unpack(zp, scheme.bits, out, dim=0)
        return cls(q, tensors[f"{prefix}.weight_scale"], zero, scheme, tensors.get(f"{prefix}.weight_g_idx"))


def stored_bytes(shape: tuple[int, int], scheme: QuantScheme, scale_dtype: torch.dtype) -> int:
    """Bytes a quantized Linear of ``shape`` (out, in) stores under ``scheme``: what
    :meth:`QuantizedWeight.to_tensors` writes (packed values, scales, zero points, g_idx) less the
    ``weight_shape`` record, which is what ``evals.size.weight_stats`` counts into bits/weight. The
    bits budget prices its candidates with it before anything is written."""
    out, inp = shape
    groups = scheme.num_groups(inp)
    total = out * packed_length(inp, scheme.bits) * 4 + out * groups * scale_dtype.itemsize
    if not scheme.symmetric:
        total += packed_length(out, scheme.bits) * groups * 4
    if scheme.actorder == "group":
        total += inp * 4
    return total


def expert_targets(plan: dict[str, QuantScheme]) -> dict[str, str]:
    """Expert Linear -> one ``re:`` target covering its block's experts, for the blocks whose
    quantized experts share one scheme. vLLM's fused MoE layer looks its scheme up under the
    names ``<block>.experts.0.gate_proj`` / ``up_proj`` / ``down_proj`` whatever the family calls
    them (Mixtral: w1, w3, w2), so exact per-Linear targets would leave a Mixtral's experts
    unmatched; and transformers finds the experts' group by a ``re:`` target naming experts."""
    schemes: dict[str, set] = defaultdict(set)
    for name, scheme in plan.items():
        m = EXPERT_LINEAR.fullmatch(name)
        if m:
            schemes[m["experts"]].add(scheme)
    # numbered children only: transformers' fused experts module has an act_fn child, which a
    # target matching it would have compressed-tensors try (and refuse) to quantize
    return {name: f"re:{re.escape(m['experts'])}\\.\\d+\\..*" for name in plan
            if (m := EXPERT_LINEAR.fullmatch(name)) and len(schemes[m["experts"]]) == 1}


def quantization_config(plan: dict[str, QuantScheme], ignored: list[str]) -> dict:
    """The ``quantization_config`` block of config.json: one config group per scheme (a sparse
    block's experts under one regex target, :func:`expert_targets`)."""
    by_scheme: dict[QuantScheme, dict[str, None]] = defaultdict(dict)  # targets, in order, once each
    regex = expert_targets(plan)
    for name, scheme in plan.items():
        by_scheme[scheme][regex.get(name, name)] = None
    groups = {}
    for i, (scheme, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: -len(kv[1]))):
        per_channel = scheme.group_size == -1
        groups[f"group_{i}"] = {
            "targets": sorted(names),
            "weights": {
                "num_bits": scheme.bits,
                "type": "int",
                "symmetric": scheme.symmetric,
                "strategy": "channel" if per_channel else "group",
                "group_size": None if per_channel else scheme.group_size,
                "dynamic": False,
                "actorder": scheme.actorder,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignored),
        "kv_cache_scheme": None,
    }


def linear_schemes(config: dict, linear_names: list[str]) -> dict[str, QuantScheme]:
    """Which of ``linear_names`` are quantized, and how, per a config.json dict."""
    qc = config.get("quantization_config")
    if not qc:
        return {}
    ignore = qc.get("ignore") or []
    plan = {}
    for group_name, group in config_groups(qc).items():
        scheme = _scheme_from_args(group_name, group.get("weights") or {})
        for target in group.get("targets", []):
            for name in linear_names:
                if name in plan or any(matches(name, p) for p in ignore):
                    continue
                # "Linear" targets every Linear module, as in llm-compressor recipes.
                if target == "Linear" or matches(name, target):
                    plan[name] = scheme
    return plan


def config_groups(qc: dict) -> dict[str, dict]:
    """The config groups of a ``quantization_config`` lowbit can read; a ValueError naming what is not."""
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        raise ValueError(
            f"unsupported quantization_config (quant_method={qc.get('quant_method')!r}, "
            f"format={qc.get('format')!r}); lowbit reads compressed-tensors {FORMAT!r} checkpoints"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError(f"quantization_config.config_groups must map group names to groups, got {groups!r:.60}")
    return groups


def _scheme_from_args(group_name: str, args: dict) -> QuantScheme:
    strategy = args.get("strategy")
    if args.get("type", "int") != "int" or strategy not in ("group", "channel"):
        raise ValueError(
            f"config group {group_name!r}: {args.get('type')} weights with strategy {strategy!r} "
            "are not supported; lowbit runs int weights with group or channel strategy"
        )
    if args.get("dynamic"):
        raise ValueError(f"config group {group_name!r}: dynamic weight quantization is not supported")
    try:
        group = -1 if strategy == "channel" else int(args["group_size"])
        return QuantScheme(bits=int(args["num_bits"]), group_size=group, symmetric=bool(args.get("symmetric", True)),
                           actorder=args.get("actorder"))
    except (KeyError, TypeError) as e:
        raise ValueError(f"config group {group_name!r}: its weights lack a usable {e}") from None
