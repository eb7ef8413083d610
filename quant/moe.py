"""Mixture-of-experts models for calibration: one Linear per expert, and how experts see tokens.

transformers 5 keeps a layer's experts fused in 3-D parameters (``experts.gate_up_proj``
[E, 2I, D], ``experts.down_proj`` [E, D, I]) and converts the Hub's per-expert tensors into them
while loading (and back while saving). lowbit quantizes, stores and runs one Linear per expert
and projection, under the Hub's names (``block_sparse_moe.experts.3.w1``, ``mlp.experts.3.gate_proj``),
which is also what vLLM reads for a compressed-tensors MoE checkpoint. :func:`unfuse_experts`
turns a loaded transformers model into that shape, so the calibration pipeline's hooks, the plan
and the checkpoint writer see ordinary Linears.

Which tokens reach an expert during calibration (:class:`CalibrationMoE`, ``statistics``):
``"all"`` (the default) runs every token through every expert for the Hessians only, while the
block's output keeps the router's choice; ``"routed"`` feeds each expert its routed tokens, as at
inference. With routed tokens a rarely chosen expert gets a Hessian of low rank or none at all;
tests/test_moe.py and bench/results/moe/expert-statistics-*.json measure the two (docs/models.md).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from quant.architectures import ARCHITECTURES, decoder_layers

STATISTICS = ("all", "routed")
# one expert's Linear in a mixture-of-experts checkpoint: <block>.experts.<e>.<projection>
EXPERT_LINEAR = re.compile(r"(?P<experts>.+\.experts)\.\d+\.[^.]+")


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k], experts [N, k])`` from router logits [N, E]: softmax in float32 over
    all experts, the top ``k``, renormalized to sum to 1 when the family does (Mixtral always,
    Qwen-MoE with ``norm_topk_prob``), as transformers computes them. Weights stay float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Expert(nn.Module):
    """One expert's gated MLP, its Linears named as the family's checkpoints name them."""

    def __init__(self, projections: tuple[str, str, str], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 act):
        super().__init__()
        self.projections, self.act = projections, act
        for name, w in zip(projections, (gate, up, down)):
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(w.detach().clone(), requires_grad=False)
            self.add_module(name, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.projections)
        return down(self.act(gate(x)) * up(x))


class CalibrationMoE(nn.Module):
    """A transformers sparse block with its experts unfused: same routing (its own router module),
    same output, and the experts as :class:`Expert` modules the calibration hooks can reach.

    Every expert is called on every forward, in order, even with no token routed to it (an empty
    batch): the lockstep pass needs every calibration batch to take the same path through a layer."""

    def __init__(self, block: nn.Module, projections: tuple[str, str, str], statistics: str = "all"):
        super().__init__()
        if statistics not in STATISTICS:
            raise ValueError(f"expert statistics must be one of {', '.join(STATISTICS)}, got {statistics!r}")
        fused = block.experts
        gate_up, down = fused.gate_up_proj.detach(), fused.down_proj.detach()
        width = down.shape[-1]
        self.gate = block.gate  # the router: transformers' own module, kept in float
        self.experts = nn.ModuleList(
            Expert(projections, gate_up[e, :width], gate_up[e, width:], down[e], fused.act_fn)
            for e in range(gate_up.shape[0]))
        for name in ("shared_expert", "shared_expert_gate"):  # Qwen2-MoE
            if hasattr(block, name):
                self.add_module(name, getattr(block, name))
        self.statistics = statistics

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        _, weights, chosen = self.gate(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            # "all": the expert's Linears see every token (their Hessians), the block keeps the routed rows
            y = expert(x)[rows] if self.statistics == "all" else expert(x[rows])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def unfuse_experts(model: nn.Module, statistics: str = "all") -> nn.Module:
    """Replace each fused transformers sparse block of a MoE model by a :class:`CalibrationMoE`
    registered under the checkpoint's name (Mixtral: ``block_sparse_moe``, which transformers 5
    calls ``mlp``): state_dict, plan and checkpoint names are then the Hub's. A model of a
    family without experts, or already unfused, is returned unchanged."""
    arch = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))
    experts = arch.experts if arch else None
    if experts is None:
        return model
    for layer in decoder_layers(model)[1]:
        block = layer.mlp
        if isinstance(block, CalibrationMoE) or not hasattr(getattr(block, "experts", None), "gate_up_proj"):
            continue  # a dense layer (Qwen's mlp_only_layers), or done
        unfused = CalibrationMoE(block, experts.projections, statistics)
        del layer.mlp
        layer.add_module(experts.block, unfused)
        # the layer's forward calls self.mlp: an instance attribute outside _modules, so the
        # block is named once (under experts.block) in named_modules and state_dict
        layer.__dict__["mlp"] = unfused
    return model


def set_statistics(model: nn.Module, statistics: str) -> None:
    """Choose, for every unfused block of ``model``, which tokens its experts' Hessians see."""
    if statistics not in STATISTICS:
        raise ValueError(f"expert statistics must be one of {', '.join(STATISTICS)}, got {statistics!r}")
    for m in model.modules():
        if isinstance(m, CalibrationMoE):
            m.statistics = statistics


def routed_counts(model: nn.Module, samples: torch.Tensor) -> dict[str, torch.Tensor]:
    """How many tokens of ``samples`` the router sends to each expert, per sparse block (float model)."""
    counts, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, CalibrationMoE):
            def hook(router, args, out, name=name, experts=len(m.experts)):
                counts[name] = counts.get(name, 0) + torch.bincount(out[2].flatten(), minlength=experts).cpu()
            handles.append(m.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(samples)
    finally:
        for h in handles:
            h.remove()
    return counts



def routers(model: nn.Module) -> list[str]:
    """The router (``gate``) of every unfused sparse block: never quantized, and listed in a
    checkpoint's ``ignore`` so that no loader that targets by class (``Linear``) quantizes it."""
    return [f"{name}.gate" for name, m in model.named_modules() if isinstance(m, CalibrationMoE)]
