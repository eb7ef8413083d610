"""Σ xᵀx accumulated on the blocks of its upper triangle: the Gram matrices (GPTQ's Hessians) the
lockstep pass sums batch by batch (``quant.sequential``)."""

from __future__ import annotations

import torch


def _block_edges(k: int, blocks: int) -> list[int]:
    blocks = blocks if k >= 512 else 1  # narrow inputs: one product is as fast
    return [k * i // blocks for i in range(blocks + 1)]


def add_gram(total: torch.Tensor, x: torch.Tensor, blocks: int = 4) -> None:
    """``total += xᵀx`` for ``x`` [n, k], on the blocks of the upper triangle only: xᵀx is
    symmetric, so (blocks + 1) / (2 blocks) of one matmul's multiplications, accumulated in
    place (no temporary). :func:`mirror_upper` completes the lower blocks once, at the end."""
    edges = _block_edges(x.shape[1], blocks)
    for i in range(len(edges) - 1):
        a = x[:, edges[i]:edges[i + 1]]
        for j in range(i, len(edges) - 1):
            total[edges[i]:edges[i + 1], edges[j]:edges[j + 1]].addmm_(a.T, x[:, edges[j]:edges[j + 1]])


def mirror_upper(total: torch.Tensor, blocks: int = 4) -> torch.Tensor:
    """The symmetric matrix whose upper blocks :func:`add_gram` accumulated (a new tensor)."""
    edges = _block_edges(total.shape[0], blocks)
    out = total.clone()
    for i in range(len(edges) - 1):
        for j in range(i + 1, len(edges) - 1):
            out[edges[j]:edges[j + 1], edges[i]:edges[i + 1]] = total[edges[i]:edges[i + 1], edges[j]:edges[j + 1]].T
    return out
