"""runtime/native/decode_ops.cpp: a CPU decode step's small ops (add + RMSNorm, RoPE of q and k,
SiLU-and-multiply, lm_head's bf16 product for few rows) against the PyTorch code they replace, and
the decoder with them against the decoder without (LOWBIT_NATIVE=0 keeps PyTorch)."""

import pytest
import torch
import torch.nn.functional as F

from runtime import native
from runtime.cpu_linear import NarrowLinear
from runtime.load import use_native_ops
from runtime.model import MLP, Attention
from runtime.norms import RMSNorm
from runtime.rope import apply_rope, token_major

ops = native.load("decode_ops")
pytestmark = pytest.mark.skipif(ops is None, reason="the native kernels cannot be built here")


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 100), (40, 64)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_the_add_and_the_norm(rows, hidden, with_residual):
    x, residual, weight = randn(rows, 1, hidden), randn(rows, 1, hidden, seed=1), randn(hidden, seed=2)
    s = x + residual if with_residual else x
    want = F.rms_norm(s, (hidden,), weight, 1e-5)
    got, got_sum = ops.add_rms_norm(x, residual if with_residual else None, weight, 1e-5)
    assert torch.equal(got_sum, s)  # one float32 add: exact
    # the sum of squares in another order: within a few float32 roundings of each value
    torch.testing.assert_close(got, want, rtol=4e-7 * 8, atol=1e-6)


def test_add_rms_norm_reads_a_view():
    x = randn(2, 5, 64)[:, -1:]  # Decoder.forward's last position of a prompt
    got, _ = ops.add_rms_norm(x, None, torch.ones(64), 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (64,), torch.ones(64), 1e-6), rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_rope_qk_is_bit_for_bit_the_reference(per_sequence):
    b, t, hq, hk, d = 2, 3, 4, 2, 32
    qkv = randn(b, t, (hq + 2 * hk) * d)
    shape = (b, 1, t, d) if per_sequence else (t, d)
    cos, sin = randn(*shape, seed=1), randn(*shape, seed=2)
    want = apply_rope(qkv[..., :(hq + hk) * d].view(b, t, hq + hk, d), token_major(cos), token_major(sin))
    assert torch.equal(ops.rope_qk(qkv, cos, sin, hq, hk), want)


@pytest.mark.parametrize("width", [1536, 37])
def test_silu_mul_matches_the_two_ops(width):
    gate_up = randn(3, 1, 2 * width) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-7)
    g16 = gate_up.bfloat16()
    want = F.silu(g16[..., :width]) * g16[..., width:]  # each op rounded to bf16, as the native one does
    got = ops.silu_mul(g16)
    assert got.dtype == torch.bfloat16
    # silu's exp differs from PyTorch's in the last float bits: at most one bf16 step apart, rarely
    steps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30) * 128
    assert float(steps.max()) <= 1.0 and float((got != want).float().mean()) < 0.02


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(130, 576), (3, 70), (64, 2048)])
def test_bf16_gemv_sums_the_bf16_products_in_float32(rows, n, k):
    if not ops.gemv_usable():
        pytest.skip("no AVX512-BF16 here")
    weight, a = randn(n, k, dtype=torch.bfloat16), randn(rows, k, seed=1)
    exact = a.bfloat16().double() @ weight.double().t()  # the rows rounded to bf16 once, as the PyTorch path
    got = ops.bf16_gemv(weight, a)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    bound = 1e-6 * k * (a.bfloat16().double().abs() @ weight.double().abs().t())  # float32 summation
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert torch.equal(ops.bf16_gemv(weight, a.bfloat16()), got)  # bf16 rows are taken as they are


def test_the_parallel_paths_equal_the_serial_ones():
    """lm_head's product from 257 blocks of four outputs and the norm from 17 rows split over the threads
    (decode_ops.cpp's grains; fewer run on the calling thread): each output is computed alone, so one
    thread and two give the same bits, and two threads the reference's values."""
    threads, outputs = torch.get_num_threads(), {}
    weight, a = randn(4 * 257 + 3, 96, dtype=torch.bfloat16), randn(2, 96, seed=1)
    x, residual, norm = randn(40, 1, 64), randn(40, 1, 64, seed=1), randn(64, seed=2)
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outputs[t] = [*ops.add_rms_norm(x, residual, norm, 1e-5)]
            if ops.gemv_usable():
                outputs[t].append(ops.bf16_gemv(weight, a))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one, two) for one, two in zip(outputs[1], outputs[2], strict=True))
    torch.testing.assert_close(outputs[2][0], F.rms_norm(x + residual, (64,), norm, 1e-5), rtol=4e-7 * 8, atol=1e-6)
    if ops.gemv_usable():
        exact = a.bfloat16().double() @ weight.double().t()
        assert bool(((outputs[2][2].double() - exact).abs() <= 1e-6 * 96 * (a.bfloat16().double().abs()
                                                                            @ weight.double().abs().t())).all())


def test_bad_input_is_named():
    with pytest.raises(RuntimeError, match="1 <= M <= 4"):
        ops.bf16_gemv(randn(8, 32, dtype=torch.bfloat16), randn(5, 32))
    with pytest.raises(RuntimeError, match="weight: a contiguous bf16"):
        ops.bf16_gemv(randn(8, 32), randn(1, 32))
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(randn(1, 8), randn(1, 9), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"\(Hq \+ 2 Hk\) D"):
        ops.rope_qk(randn(1, 1, 100), randn(1, 10), randn(1, 10), 2, 1)


def test_narrow_linear_on_the_gemv_agrees_with_torch_for_few_rows_only():
    if not ops.gemv_usable():
        pytest.skip("no AVX512-BF16 here")
    linear = torch.nn.Linear(96, 200, bias=True)
    linear.weight.data = linear.weight.data.bfloat16()
    head = NarrowLinear(linear)
    for rows in (1, 4, 6):  # 6: more rows than the gemv takes, PyTorch's product
        x = randn(rows, 1, 96)
        want = head(x)
        head.native = ops
        got = head(x)
        head.native = None
        assert got.shape == want.shape == (rows, 1, 200) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)  # torch rounds its sums to bf16
        if rows == 6:
            assert torch.equal(got, want)


def w4_checkpoint(tmp_path, kind: str = "llama"):
    """A tiny model's W4 (group 32) checkpoint, lm_head kept float, stored in bf16."""
    from lowbit_testing.tiny_models import tiny_model
    from quant import checkpoint_write
    from quant.affine import QuantScheme
    from quant.plan import plan_layers
    from quant.quantize import quantize_model

    model, tok = tiny_model(kind, seed=3)
    weights, _ = quantize_model(model, plan_layers(model, QuantScheme(4, 32, symmetric=False), ["lm_head"]), "rtn",
                                progress=False)
    return checkpoint_write.save(model, weights, tmp_path / kind, tokenizer=tok, dtype=torch.bfloat16)


def test_the_decoder_runs_them_where_built_and_pytorch_without(tmp_path, monkeypatch):
    import runtime

    path = w4_checkpoint(tmp_path)
    model = runtime.load(path, cpu_kernels=True)
    modules = [m for m in model.decoder.modules() if isinstance(m, (RMSNorm, Attention, MLP, NarrowLinear))]
    assert {type(m) for m in modules} == {RMSNorm, Attention, MLP, NarrowLinear}
    assert all(m.native is ops for m in modules if not isinstance(m, NarrowLinear))
    assert model.decoder.lm_head.native is (ops if ops.gemv_usable() else None)
    ids = torch.randint(0, model.decoder.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    got = model.logits(ids)
    assert len(list(model.generate(list(range(5, 15)), max_new_tokens=4))) == 4
    use_native_ops(model.decoder, None, model.dtype)  # the PyTorch ops on the same weights
    assert all(m.native is None for m in modules)
    want = model.logits(ids)
    # bf16 activations between the Linears: a last-bit difference may round one of them the other way
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())
    one = ids[:1, :1]  # one row: lm_head on the gemv where it runs
    use_native_ops(model.decoder, ops, model.dtype)
    got_one = model.logits(one)
    use_native_ops(model.decoder, None, model.dtype)
    torch.testing.assert_close(got_one, model.logits(one), rtol=2 ** -7, atol=0.02 * float(want.abs().max()))

    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    off = runtime.load(path, cpu_kernels=True)
    kinds = (RMSNorm, Attention, MLP, NarrowLinear)
    assert all(m.native is None for m in off.decoder.modules() if isinstance(m, kinds))
    assert float((off.logits(ids) - want).abs().max()) < 0.02 * float(want.abs().max())


def test_float16_models_keep_the_pytorch_ops():
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    decoder = Decoder(cfg)
    use_native_ops(decoder, ops, torch.float16)  # neither the norm, RoPE, SiLU nor the gemv takes float16
    assert all(getattr(m, "native", None) is None for m in decoder.modules())
    use_native_ops(decoder, ops, torch.bfloat16)  # bf16 activations: SiLU-and-multiply only
    assert [type(m) for m in decoder.modules() if getattr(m, "native", None) is not None] == [MLP]
