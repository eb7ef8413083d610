"""Gemma 3 and Phi-3 on the GPU path: the fused small ops and the Triton attention kernels over a
quantized cache (in the Triton interpreter without a GPU) give the PyTorch reference's logits.
Gemma's query scale rides on the queries and its local layers read their own RoPE, so the kernels
need no change; Gemma 2's soft-capping has no kernel (tests/test_architectures_gemma.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE  # first: it picks the interpreter without a GPU

from kvquant import parse_kv
from runtime.cache_lockstep import LockstepCache
from runtime.kernels import attention as kernels
from runtime.model import Decoder, DecoderConfig

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16)
FAMILIES = {
    "gemma3": dict(model_type="gemma3_text", query_pre_attn_scalar=24, sliding_window=12,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
    "phi3": dict(model_type="phi3", max_position_embeddings=64, original_max_position_embeddings=16,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                               "long_factor": [1.0 + 0.5 * i for i in range(8)]}),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_on_the_kernels_matches_the_reference(family):
    """20 tokens decoded one at a time over an int4 cache (a block fills and quantizes at 16; Gemma 3's
    window of 12 and Phi-3's switch to the long RoPE factors at 16 both bind)."""
    cfg = DecoderConfig.from_hf({**SHAPE, **FAMILIES[family]})
    torch.manual_seed(0)
    model = Decoder(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (offset +) weight away from 1, so a dropped norm would show
                p.copy_(torch.randn(p.shape) * 0.2 + (0.0 if cfg.norm_offset else 1.0))
    scheme = parse_kv("int4-g16-r16")
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    plain, fused = (LockstepCache(2, 2, 1, 16, 32, torch.float32, DEVICE, scheme=scheme) for _ in range(2))
    want, got = [], []
    with torch.inference_mode():
        for pos in range(20):
            model.use_kernels(False)
            model.attention_asked = "reference"  # backends picked by name
            want.append(model(ids[:, pos:pos + 1], plain, pos))
            model.use_kernels(True)
            model.attention_asked = "triton"
            got.append(model(ids[:, pos:pos + 1], fused, pos))
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-4, rtol=1e-4)
