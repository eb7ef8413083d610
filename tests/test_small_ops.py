"""The fused small ops (runtime/kernels/small_ops.py) against the decoder's PyTorch reference, in
the Triton interpreter on CPU (tests/conftest.py), in bf16 as on a GPU."""

import torch
import torch.nn.functional as F

from runtime.kernels.small_ops import add_rmsnorm, rope_qkv, silu_mul
from runtime.model import RMSNorm, apply_rope

# a bf16 step: the kernels reduce in another order than torch, and the interpreter rounds fp32 to
# bf16 by its own rule (a GPU rounds to nearest even, as torch)
BF16 = dict(atol=2e-2, rtol=2e-2)


def test_add_rmsnorm_equals_the_add_then_the_norm():
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(3, 2, 96, generator=g).bfloat16() for _ in range(2))
    norm = RMSNorm(96, 1e-5).bfloat16()
    norm.weight.data = torch.randn(96, generator=g).bfloat16()
    out, summed = add_rmsnorm(x, res, norm.weight, norm.eps)
    torch.testing.assert_close(summed, x + res, **BF16)
    x32, res32 = x.float(), res.float()
    assert torch.equal(add_rmsnorm(x32, res32, norm.weight.float(), norm.eps)[1], x32 + res32)  # the stream's add
    torch.testing.assert_close(out, norm(x + res), **BF16)
    alone, same = add_rmsnorm(x, None, norm.weight, norm.eps)  # the first layer: no add
    assert torch.equal(same, x)
    torch.testing.assert_close(alone, norm(x), **BF16)


def test_rope_on_the_joined_projection_equals_rope_per_tensor():
    g = torch.Generator().manual_seed(1)
    B, T, H, K, D = 2, 5, 4, 2, 16
    qkv = torch.randn(B, T, (H + 2 * K) * D, generator=g).bfloat16()
    angles = torch.randn(B, 1, T, D // 2, generator=g)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()  # per-sequence positions, as the engine's decode
    q, k, v = qkv.split([H * D, K * D, K * D], -1)
    q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))
    got_q, got_k, got_v = rope_qkv(qkv, cos, sin, H, K, D)
    torch.testing.assert_close(got_q, apply_rope(q, cos, sin), **BF16)
    torch.testing.assert_close(got_k, apply_rope(k, cos, sin), **BF16)
    assert torch.equal(got_v, v) and got_k.stride() == got_v.stride()  # the cache write copies nothing
    shared = rope_qkv(qkv, cos[0, 0], sin[0, 0], H, K, D)[0]  # one position range for the batch: [T, D]
    torch.testing.assert_close(shared, apply_rope(q, cos[0, 0], sin[0, 0]), **BF16)


def test_silu_and_multiply_of_the_joined_gate_and_up():
    gate_up = torch.randn(3, 1, 2 * 80, generator=torch.Generator().manual_seed(2)).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **BF16)


def test_rope_of_a_decode_step_writes_k_and_v_into_the_cache_residual():
    """The decode step's RoPE launch also stores each sequence's new key and value at row
    ``start % block`` of its residual block (what kv_write's residual launch did), nothing else."""
    g = torch.Generator().manual_seed(3)
    S, H, K, D, block = 3, 4, 2, 16, 16
    qkv = torch.randn(S, 1, (H + 2 * K) * D, generator=g).bfloat16()
    emb = torch.randn(S, 1, 1, D // 2, generator=g).repeat(1, 1, 1, 2)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    residual_k, residual_v = (torch.randn(S, K, block, D, generator=g).bfloat16() for _ in range(2))
    before_k, before_v = residual_k.clone(), residual_v.clone()
    starts = torch.tensor([0, 21, 47], dtype=torch.int32)  # rows 0, 5 and 15 (the last fills its block)
    q, k, v = rope_qkv(qkv, cos, sin, H, K, D, store=(residual_k, residual_v, starts))
    plain = rope_qkv(qkv, cos, sin, H, K, D)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), plain))  # the same outputs as without the store
    for s, row in enumerate(starts.remainder(block).tolist()):
        assert torch.equal(residual_k[s, :, row], k[s, :, 0]) and torch.equal(residual_v[s, :, row], v[s, :, 0])
        others = [r for r in range(block) if r != row]
        assert torch.equal(residual_k[s, :, others], before_k[s, :, others])
        assert torch.equal(residual_v[s, :, others], before_v[s, :, others])
