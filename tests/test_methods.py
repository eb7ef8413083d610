"""The method registry and the per-architecture table: today's checkpoints unchanged, method lists
checked before any work, one home for each family's facts."""

import hashlib
import json
import warnings
from dataclasses import dataclass

import pytest
import torch

from quant import architectures, checkpoint
from quant import methods as registry
from quant.affine import QuantScheme
from quant.awq import AWQConfig
from quant.gptq import GPTQConfig
from quant.models import load_float_model, load_lazily
from quant.plan import Override, plan_layers
from quant.quantize import quantize_model
from tiny import tiny_llama

# sha256 over every tensor (name, dtype, shape, bytes) and the quantization_config of checkpoints
# written by main's code before the registry (commit 0708032: string methods dispatched with
# startswith/endswith), with the script's settings below: the refactor must not move one bit.
# Same machine class, torch and thread count assumed: CPU float results are not portable bit
# for bit across BLAS builds, so on another platform recompute them with the reference commit.
REFERENCE = {
    "rtn-w4g32": "e7592c5fd4f1908409f8c9b1484a1da8a1bd8fab73d04283912b0e0ab00e1757",
    "rtn-w8pc-sym": "90b0b36ff27a058e3585dca3ec907195d78c0e9a6436f4a6c84d98bf393f2a60",
    "rtn-w4g32-down8": "e05fc94cd620909b86d1d3c5eb9397dcf966837d95b295fd003899b32c41acba",
    "gptq-w4g32": "5286d0ebd7dcf4f9ff29e8c2f24560a008771ae4344ff0241fd1ede95d23b08d",
    "gptq-w4g32-sym-group": "c9b4bed691d4c3ba7608c10cfdcb564366a689edb60fcca10a50e4f866391d50",
    "gptq-untied-lm_head": "b2542f8145ec8f987a0089583e607f6fca4ee62862312231a6d82527ea33f3af",
    "awq-w4g32": "b4dede6880bb9fecc1ddc9294e6a80c4719d6af6699231ebabf5dc2913ec223e",
    "awq+gptq-w4g32": "9f674e6a7da817d31afa78d5eeece9941cfd09d46dbd64627cbdc16bb6539ca8",
}
# case -> (methods, (bits, group, symmetric), GPTQ act-order, overrides, tied embeddings)
CASES = {
    "rtn-w4g32": (["rtn"], (4, 32, False), "weight", [], True),
    "rtn-w8pc-sym": (["rtn"], (8, -1, True), "weight", [], True),
    "rtn-w4g32-down8": (["rtn"], (4, 32, False), "weight", [Override("re:.*down_proj", bits=8)], True),
    "gptq-w4g32": (["gptq"], (4, 32, False), "weight", [], True),
    "gptq-w4g32-sym-group": (["gptq"], (4, 32, True), "group", [], True),
    "gptq-untied-lm_head": (["gptq"], (4, 32, False), "weight", [], False),  # lm_head quantized outside the layers
    "awq-w4g32": (["awq"], (4, 32, False), "weight", [], True),
    "awq+gptq-w4g32": (["awq", "gptq"], (4, 32, False), "weight", [], True),
}


def checkpoint_digest(out) -> str:
    h = hashlib.sha256()
    for name, t in sorted(checkpoint.read_tensors(out).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(checkpoint.read_config(out)["quantization_config"], sort_keys=True).encode())
    return h.hexdigest()


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoints_from_todays_recipes_stay_bit_identical(tmp_path, case):
    """As the pipeline runs them: calibrated chains read the layers lazily, the plan takes its
    act-order from the rounding method, GPTQ's dampening is pinned (its default may move)."""
    names, (bits, group, symmetric), actorder, overrides, tie = CASES[case]
    source, tok = tiny_llama(hidden=64, layers=2, tie=tie)
    source.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    chain = registry.chain(names)
    settings = {"gptq": GPTQConfig(actorder=actorder, dampening=0.1), "awq": AWQConfig()}
    settings = {m.name: settings[m.name] for m in chain if m.name in settings}
    calibrated = any(m.needs_data for m in chain)
    model, tok, lazy = load_lazily(tmp_path / "model") if calibrated else (*load_float_model(tmp_path / "model"), None)
    rounding = chain[-1]
    scheme = QuantScheme(bits, group, symmetric, rounding.actorder(settings.get(rounding.name, rounding.settings())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_layers(model, scheme, ["lm_head"] if tie else [], overrides)
    ids = torch.randint(0, source.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(3))
    quantized, _ = quantize_model(model, plan, names, samples=ids if calibrated else None, scale_dtype=torch.bfloat16,
                                  progress=False, lazy=lazy, **settings)
    out = checkpoint.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, dtype=torch.bfloat16)
    assert checkpoint_digest(out) == REFERENCE[case]
