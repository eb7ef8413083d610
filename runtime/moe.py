"""The mixture-of-experts block of the runtime's decoder (Mixtral, Qwen3-MoE, Qwen2-MoE).

Checkpoints store one Linear per expert and projection (``quant/moe.py`` says why); each expert
is the decoder's dense MLP (``runtime.model.MLP``, passed in by ``runtime.model``, which imports
this module: not the reverse) built through the decoder's ``make_linear``, so a quantized expert
is a ``QuantLinear`` and runs the W4/W8 kernels on CUDA, its gate and up joined into one GEMM at
load like a dense MLP's. The router (``gate``) and Qwen2-MoE's ``shared_expert_gate`` are plain
float Linears whatever the checkpoint says: lowbit never quantizes them.

Two ways to run the experts, with the same routing and the same result:

- sparse (the default): tokens sorted by expert, one call per expert on its tokens only. One
  host sync per block (the tokens per expert), so it cannot be captured in a CUDA graph.
- dense: every expert on every token, each output weighted by the token's routing weight for
  it (zero where not chosen). No sync and no data-dependent shape: what runs while a CUDA graph
  is being captured (the engine's decode steps), at ``num_experts / top_k`` times the expert
  work. A grouped kernel that runs only the routed tokens inside a graph is later work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from quant.moe import route

if TYPE_CHECKING:  # names for the annotations only
    from runtime.model import DecoderConfig, LinearFactory


class SparseMoE(nn.Module):
    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory, expert: type[nn.Module]):
        """``expert(cfg, prefix, make_linear, width, projection names)`` builds one expert (the MLP)."""
        super().__init__()
        moe = cfg.moe
        self.top_k, self.normalize = moe.top_k, moe.normalize
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router: always float
        self.experts = nn.ModuleList(
            expert(cfg, f"{prefix}.experts.{e}", make_linear, moe.width, moe.projections)
            for e in range(moe.num_experts))
        if moe.shared_width:  # Qwen2-MoE: an expert every token goes through, weighed by a sigmoid gate
            self.shared_expert = expert(cfg, f"{prefix}.shared_expert", make_linear, moe.shared_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = route(self.gate(flat), self.top_k, self.normalize)
        capturing = flat.is_cuda and torch.cuda.is_current_stream_capturing()
        out = (self.dense if capturing else self.sparse)(flat, weights, chosen)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(x.shape)

    def sparse(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each expert on the tokens routed to it (``x`` [N, D], ``weights``/``chosen`` [N, k])."""
        picks = chosen.reshape(-1)
        order = torch.argsort(picks, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(picks, minlength=len(self.experts)).tolist()  # the block's one host sync
        tokens, pick_weights = order // self.top_k, weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:  # a token picks an expert at most once: each row gets one add per expert
                rows = tokens[start:start + n]
                y = expert(x[rows]) * pick_weights[start:start + n, None]
                out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out

    def dense(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (0 where not picked)."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(-1, keepdim=True)
            out += (expert(x) * w).to(out.dtype)
        return out
