"""A quantized model's float leftovers on CPU (runtime.load.narrow_float_weights): with the CPU kernels
its embedding and lm_head stay in the checkpoint's bf16 (half the memory and bytes per token of
float32) and lm_head multiplies in bf16, as the MLPs do between their kernels; float models,
float32-stored weights and the dense reference are left as they were."""

import pytest
import torch

import runtime
from runtime.cpu_linear import NarrowLinear
from runtime.model import MLP

TOLERANCE = 0.02  # of the largest logit: bf16 activations, as the quantized Linears' kernels already use


def quantized(kind: str, tmp_path, dtype: torch.dtype):
    """A W4 (group 32, asymmetric, lm_head kept float) checkpoint of a tiny model stored in ``dtype``."""
    from lowbit_testing.tiny_models import tiny_model
    from quant import checkpoint_write
    from quant.affine import QuantScheme
    from quant.plan import plan_layers
    from quant.quantize import quantize_model

    model, tok = tiny_model(kind, seed=4)
    weights, _ = quantize_model(model, plan_layers(model, QuantScheme(4, 32, symmetric=False), ["lm_head"]), "rtn",
                                progress=False)
    return checkpoint_write.save(model, weights, tmp_path / f"{kind}-{dtype}", tokenizer=tok, dtype=dtype)


def logits_of(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    return model.logits(ids)


@pytest.mark.parametrize("kind", ["llama", "llama-untied"])
def test_a_bf16_checkpoint_keeps_its_embedding_and_lm_head_in_bf16_on_the_cpu_kernels(tmp_path, kind):
    path = quantized(kind, tmp_path, torch.bfloat16)
    kernels, reference = runtime.load(path, cpu_kernels=True), runtime.load(path, cpu_kernels=False)
    embed, head = kernels.decoder.model.embed_tokens.weight, kernels.decoder.lm_head
    assert kernels.dtype == torch.float32 and embed.dtype == torch.bfloat16
    assert isinstance(head, NarrowLinear) and head.weight.dtype == torch.bfloat16
    assert (head.weight is embed) == (kind == "llama")  # a tied lm_head still shares the embedding's tensor
    assert reference.decoder.model.embed_tokens.weight.dtype == torch.float32  # the reference: all float32
    mlps = lambda model: [m for m in model.decoder.modules() if isinstance(m, MLP)]  # noqa: E731
    assert all(m.cpu_kernel_dtype == torch.bfloat16 for m in mlps(kernels))  # bf16 between gate_up and down
    assert all(m.cpu_kernel_dtype is None for m in mlps(reference))
    assert type(reference.decoder.lm_head) is torch.nn.Linear
    vocab = kernels.decoder.cfg.vocab_size
    got, want = logits_of(kernels, vocab), logits_of(reference, vocab)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < TOLERANCE * float(want.abs().max())
    assert len(list(kernels.generate(list(range(5, 15)), max_new_tokens=3))) == 3


def test_float32_stored_weights_and_float_models_are_not_narrowed(tmp_path):
    from lowbit_testing.tiny_models import save_model, tiny_model

    stored_fp32 = runtime.load(quantized("llama", tmp_path, torch.float32), cpu_kernels=True)
    assert stored_fp32.decoder.model.embed_tokens.weight.dtype == torch.float32  # never rounded at load
    assert type(stored_fp32.decoder.lm_head) is torch.nn.Linear
    model, tok = tiny_model("llama")
    float_model = runtime.load(save_model(model.to(torch.bfloat16), tok, tmp_path / "float"), cpu_kernels=True)
    assert all(p.dtype == torch.float32 for p in float_model.decoder.parameters())  # the float model as before


@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (2, 5), (7,)])
def test_narrow_linear_matches_f_linear_in_the_weight_dtype(rows):
    """NarrowLinear multiplies as weight @ x.T (a matrix-vector product for one row, faster than
    F.linear's bf16 path on lm_head shapes): the same product as F.linear in bf16, contiguous,
    in the activations' dtype and shape."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    linear.weight.data = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
    x = torch.randn(*rows, 256, generator=g)
    got = NarrowLinear(linear)(x)
    want = torch.nn.functional.linear(x.bfloat16(), linear.weight).float() + linear.bias
    assert got.shape == (*rows, 96) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
