"""The Linear backend seam (runtime/linear_backends/): each layer's backend chosen once, at load, with
every backend passed over and why; switches by name; fall_back to the next backend; the checkpoint's
codes read back exactly; a new backend is one class and one entry in the priority list."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from quant.affine import QuantScheme
from runtime import backend, cpu_linear, linear_backends
from runtime.linear import QuantLinear
from runtime.linear_backends import LinearBackend, LinearCase
from test_cpu_linear import quant_layer


class Doubled(LinearBackend):
    """A stand-in backend: the dense weight, run by F.linear, each call recorded."""

    name = "doubled"
    devices = ("cpu",)

    def __init__(self):
        self.calls = []

    def refuses(self, case: LinearCase) -> str | None:
        return super().refuses(case) or (None if case.scheme.bits == 4 else "4-bit layers only")

    def build(self, layer, case: LinearCase) -> torch.Tensor:
        return layer.dequantized_weight(case.dtype)

    def run(self, weight, x, bias):
        self.calls.append(x.numel() // x.shape[-1])  # rows
        return F.linear(x, weight, bias)


def with_backend(new: LinearBackend, before: str) -> list:
    """A copy of the priority list with ``new`` inserted before the backend called ``before``."""
    priority = list(linear_backends.PRIORITY)
    priority.insert([b.name for b in priority].index(before), new)
    return priority


def test_a_new_backend_is_one_class_and_one_entry_in_the_priority_list():
    fake = Doubled()
    priority = with_backend(fake, "cpu-int4")
    layer = quant_layer(32, 128, QuantScheme(4, 32, True), seed=1)
    layer.materialize(torch.float32, priority=priority)
    assert layer.backend_name == "doubled"
    assert [r.name for r in layer.choice.rejected] == ["triton"] and "cuda" in layer.choice.rejected[0].reason
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(torch.float32), layer.bias))
    assert fake.calls == [3]
    eight = quant_layer(32, 128, QuantScheme(8, -1, True), seed=2)  # refused: the next one in the list
    eight.materialize(torch.float32, priority=priority)
    assert eight.backend_name == "cpu-int8" and ("doubled", "4-bit layers only") in [
        (r.name, r.reason) for r in eight.choice.rejected]
    assert backend.choose(priority, layer.case(torch.float32), only="doubled").name == "doubled"


def test_a_new_backend_in_the_priority_list_is_chosen_at_load(tmp_path, monkeypatch):
    import runtime
    from lowbit_testing.tiny_models import quantized_checkpoint
    from runtime.selfcheck import kernel_table

    path, _, _ = quantized_checkpoint("llama", tmp_path)  # W4 g32 asym
    fake = Doubled()
    monkeypatch.setattr(linear_backends, "PRIORITY", with_backend(fake, "triton"))
    model = runtime.load(path)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    logits = model.logits(ids)
    assert fake.calls and set(fake.calls) == {5}
    rows = [r for r in kernel_table(model.decoder, model.dtype) if r["kernel"] == "quant_matmul"]
    assert rows and all(r["runs"] == "doubled" and r["why"] is None for r in rows), rows
    reference = runtime.load(path, linear_backend="reference")
    assert torch.equal(logits, reference.logits(ids))  # the same dense weights and F.linear


def test_the_choice_names_every_backend_passed_over_and_why():
    layer = quant_layer(48, 256, QuantScheme(4, 64, False), seed=3)
    layer.materialize(torch.float32)
    assert layer.backend_name == "cpu-int4" and layer.on_cpu_kernel and layer.fallback_reason is None
    [triton] = layer.choice.rejected
    assert triton.name == "triton" and triton.reason.startswith("runs on cuda only")
    odd = quant_layer(40, 128, QuantScheme(4, 32, True), seed=4)  # 40 outputs: not whole int4 blocks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        odd.materialize(torch.float32)
    assert odd.backend_name == "reference"
    assert [r.name for r in odd.choice.rejected] == ["triton", "cpu-int4", "cpu-int8"]
    assert "multiple of 16" in odd.fallback_reason  # the first refusal by a backend for its device
    assert "cpu-int4: outputs not a multiple of 16" in odd.choice.explain()


@pytest.mark.parametrize("env", [{"LOWBIT_DISABLE": "cpu"}, {"LOWBIT_DISABLE": "cpu-int4"},
                                 {"LOWBIT_CPU_KERNELS": "0"}])
def test_switched_off_backends_are_passed_over_by_name(env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    layer = quant_layer(48, 256, QuantScheme(4, 64, True), seed=5)
    layer.materialize(torch.float32)
    assert layer.backend_name == "reference" and layer.fallback_reason is None  # asked for: no warning, no reason
    assert dict((r.name, r.reason) for r in layer.choice.rejected)["cpu-int4"].startswith("disabled (LOWBIT_DISABLE")
    monkeypatch.delenv("LOWBIT_DISABLE", raising=False)
    monkeypatch.delenv("LOWBIT_CPU_KERNELS", raising=False)
    layer.materialize(torch.float32, off=linear_backends.switched_off(cpu_kernels=False))  # runtime.load's argument
    assert layer.backend_name == "reference"


def test_a_backend_asked_for_by_name_runs_or_says_why_not():
    layer = quant_layer(48, 256, QuantScheme(4, 64, True), seed=6)
    layer.use_backend("reference", torch.float32)
    x = torch.randn(2, 256)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(torch.float32), layer.bias))
    layer.use_backend("cpu-int4")
    assert layer.backend_name == "cpu-int4"
    with pytest.raises(backend.NoBackend, match="cpu-int8: 4-bit codes"):
        layer.use_backend("cpu-int8")
    assert layer.backend_name == "cpu-int4"  # a refused ask leaves the layer as it was
    with pytest.raises(ValueError, match="no backend named 'int3'"):
        layer.use_backend("int3")


def test_fall_back_moves_to_the_next_backend_that_takes_the_layer():
    second = Doubled()
    priority = with_backend(second, "cpu-int8")  # after cpu-int4
    layer = quant_layer(32, 128, QuantScheme(4, 32, True), seed=7)
    layer.materialize(torch.float32, priority=priority)
    assert layer.backend_name == "cpu-int4"
    layer.fall_back("disagreed with the reference")
    assert layer.backend_name == "doubled" and layer.fallback_reason == "disagreed with the reference"
    assert ("cpu-int4", "disagreed with the reference") in [(r.name, r.reason) for r in layer.choice.rejected]
    layer.fall_back("wrong too")
    assert layer.backend_name == "reference" and [r.name for r in layer.choice.rejected] == [
        "triton", "cpu-int4", "doubled", "cpu-int8"]


def test_the_cpu_kernels_weight_replaces_the_packed_codes_and_the_layer_runs_it_unchanged():
    layer = quant_layer(64, 256, QuantScheme(4, 64, False), seed=8)
    stored = layer.state_dict()
    direct = cpu_linear.build(stored["weight_packed"], stored["weight_scale"], stored["weight_zero_point"],
                              (64, 256), layer.scheme, None)
    layer.materialize(torch.float32)
    assert "weight_packed" not in layer._buffers and torch.equal(layer.weight_packed, stored["weight_packed"])
    x = torch.randn(5, 256)
    assert torch.equal(layer(x), direct(x, layer.bias))  # the backend adds nothing to the kernel's numbers
    again = QuantLinear(256, 64, layer.scheme, bias=True)
    again.load_state_dict(layer.state_dict())
    assert again.choice is None and torch.equal(again.weight_packed, stored["weight_packed"])
    layer.load_state_dict(stored)  # new tensors: the backend's weight is dropped, the buffer back
    assert layer.choice is None and "weight_packed" in layer._buffers


def test_a_layer_used_on_its_own_chooses_at_its_first_call():
    layer = quant_layer(32, 128, QuantScheme(4, 32, True), seed=9)
    assert layer.backend_name is None
    layer(torch.randn(1, 128))
    assert layer.backend_name == "cpu-int4"
