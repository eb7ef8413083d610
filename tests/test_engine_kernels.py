"""The engine on the Triton kernels (in the interpreter without a GPU; tests/conftest.py sets
TRITON_INTERPRET=1) against the plain runtime, the CUDA-graph decode step run eagerly, the
backend's fallback, and what a decode step costs: host syncs, input copies, launches (counted on
CPU with lowbit_testing.counting), GEMM tuning at start-up.
"""

import pytest
import torch

import runtime
from kvquant import parse_kv
from runtime.attention import engine_attention
from runtime.engine import Engine
from engine_setup import FP16, INT4, greedy, model_dir, models, plain, prompts  # noqa: F401 (fixtures)


# ----------------------------------------------------------------------------- kernels


def test_triton_attention_kernels_through_the_engine(models, model_dir, prompts):
    """The GPU path, run in the Triton interpreter: quantize-on-write and decode attention over
    sequences of different lengths in one launch, and the fused small ops (add + RMSNorm, RoPE,
    SiLU-and-multiply); prompts shorter than a block, so the plain CPU path (which prefills
    through the quantizer) computes the same thing."""
    model = runtime.load(model_dir, kv=INT4)
    model.decoder.use_kernels(True)
    short = [p[:n] for p, n in zip(prompts, (5, 12, 9))]
    engine = Engine(model, max_batch=3, max_len=32, attention="triton")
    requests = engine.generate(short, greedy(14))  # 12 + 14 crosses a block: one is quantized
    assert engine.stats()["attention"] == "triton"
    assert [r.output_ids for r in requests] == [plain(models[INT4], p, 14) for p in short]


def test_chunked_prefill_through_the_kernels(model_dir, prompts):
    """Later chunks read the earlier ones back through the dequantize kernel (fp16 blocks: the
    same values the plain runtime's one-shot prefill attends to)."""
    model = runtime.load(model_dir, kv=FP16)
    engine = Engine(model, max_batch=2, max_len=48, prefill_chunk=16, attention="triton")
    requests = engine.generate([prompts[3], prompts[0]], greedy(6))  # 34 tokens: chunks at 0, 16, 32
    assert [r.output_ids for r in requests] == [plain(model, p, 6) for p in (prompts[3], prompts[0])]


def test_padded_decode_buckets_as_the_cuda_graphs_run_them(models, prompts):
    """The CUDA-graph decode step, run eagerly (no GPU here to capture it): static inputs for a
    bucket of rows, padding rows that write into free slots, the kernels' lengths bounded by the
    block table instead of the batch. Three sequences use the bucket of 4; prefilling sequences
    sit in high rows, so padding never touches them."""
    from runtime.execution import DecodeGraph, DecodeGraphs

    model = models[INT4]
    short = [p[:n] for p, n in zip(prompts, (5, 12, 9))]
    engine = Engine(model, max_batch=6, max_len=32, attention="triton")
    engine.executor.graphs = DecodeGraphs(model.decoder, engine.cache, capture=False, buckets=(2, 4))
    used, run = [], DecodeGraph.run

    def counted(self, tokens, starts):
        used.append((self.batch, self.fills))  # the bucket, and whether it writes filled blocks
        assert self.fills == any((s + 1) % engine.cache.block_size == 0 for s in starts)
        return run(self, tokens, starts)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(DecodeGraph, "run", counted)
        requests = engine.generate(short, [greedy(n) for n in (8, 5, 3)])  # 3, then 2, then 1 decoding
    assert {b for b, _ in used} == {2, 4} and len(used) == engine.stats()["decode_steps"]
    assert {f for _, f in used} == {False, True}  # 12 + 8 tokens: a block fills on one step
    assert [r.output_ids for r in requests] == [plain(model, p, n) for p, n in zip(short, (8, 5, 3))]


def test_a_scheme_without_kernels_falls_back_with_a_warning_or_fails_clearly(models):
    decoder = models[INT4].decoder
    odd = parse_kv("int4-g8-r24")  # block 24: the kernels take powers of two
    with pytest.warns(UserWarning, match="int4-g8-r24: no attention kernel for block size .* reference runs instead"):
        assert engine_attention(decoder, odd, torch.float16, "cuda").name == "reference"  # what a GPU would run
    with pytest.raises(ValueError, match="do not support block size"):
        engine_attention(decoder, odd, torch.float16, "cpu", attention="triton")
    on_cpu = engine_attention(decoder, parse_kv(INT4), torch.float16, "cpu")  # CPU: the folded codes
    assert on_cpu.name == "cpu-folded" and "CUDA" in on_cpu.rejected[0].reason


# ----------------------------------------------------------------------------- the decode step's cost


def decoding_engine(model_dir, prompts, attention, steps_left=20):
    """A bf16 engine (the GPU's dtype, so casts count) whose three requests all decode."""
    model = runtime.load(model_dir, kv=INT4, dtype=torch.bfloat16)
    engine = Engine(model, max_batch=4, max_len=64, attention=attention)
    for p in prompts[:3]:  # 5, 21 and 9 tokens: the first and last cross into block 1 while decoding
        engine.submit(p, greedy(steps_left))
    while not engine.all_decoding:
        engine.step()
    return engine


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_a_decode_step_reads_the_device_once_and_copies_inputs_once(model_dir, prompts, attention):
    """Counted with lowbit_testing.counting on CPU: the only host sync of a decode step is the read of
    the sampled tokens, the inputs go in with one copy, and a step where a sequence crosses into a
    new block adds one copy of its block-table row, never a read of the table. (The reference
    path's quantizer makes small constant tensors when a block fills: copies, not syncs.)"""
    from lowbit_testing.counting import decode_step_counts

    engine = decoding_engine(model_dir, prompts, attention)
    crossings = 0
    for _ in range(8):
        lengths = [r.computed for r in engine.scheduler.decoders()]
        crossing = any((n + 1) % engine.cache.block_size == 0 for n in lengths)
        counts = decode_step_counts(engine)
        assert counts["syncs"] == 1 and counts["ops"]["sync:tolist"] == 1, counts["ops"]
        if attention == "triton" or not crossing:
            assert counts["input_copies"] == 1 + crossing, (lengths, counts["ops"])
        crossings += crossing
    assert crossings >= 1


def test_a_decode_step_launches_9_kernels_per_layer_plus_the_block_write_when_one_fills(model_dir, prompts):
    """The CUDA path's launches, counted on CPU (ATen ops that run a kernel, plus Triton launches;
    a quantized GEMM counts as one, split-K adds a reduction): two add+RMSNorm, the q/k/v GEMM,
    RoPE writing k and v into the cache's residual blocks, decode attention (and its split combine
    when it splits), o_proj, the gate/up GEMM, SiLU-and-multiply, down_proj; the block write only
    on a step where some sequence fills a block (the host knows which)."""
    from lowbit_testing.counting import decode_step_counts

    engine = decoding_engine(model_dir, prompts, "triton")
    engine.model.decoder.use_kernels(True)
    seen = set()
    for _ in range(8):
        fills = any((r.computed + 1) % engine.cache.block_size == 0 for r in engine.scheduler.decoders())
        counts = decode_step_counts(engine)
        combine = counts["ops"].get("triton:_combine_kernel", 0) // counts["layers"]  # 0 or 1: splits or not
        assert counts["syncs"] == 1 and counts["launches_per_layer"] == [9 + fills + combine] * counts["layers"], counts
        assert counts["ops"]["triton:_add_rmsnorm_kernel"] == 2 * counts["layers"] + 1  # + the final norm
        assert "triton:_write_residual_kernel" not in counts["ops"]  # the RoPE launch wrote k and v
        assert counts["ops"].get("triton:_write_blocks_kernel", 0) == (counts["layers"] if fills else 0)
        seen.add(fills)
    assert seen == {False, True}


def test_every_gemm_m_bucket_is_tuned_before_the_first_request(kernels_on_cpu, monkeypatch):
    """On CUDA the engine asks quant_matmul's tuner for every M bucket a step can take at start-up
    (a GPU times the candidates then, not on a request): here the tuner is replaced by a recorder,
    and every M from 1 to the largest falls in a bucket that was asked."""
    from quant.affine import QuantScheme
    from runtime.execution import warm_matmul_tuning
    from runtime.kernels import quant_matmul
    from runtime.linear import QuantLinear

    layer = QuantLinear(64, 32, QuantScheme(4, 32, True))
    decoder = torch.nn.Sequential(torch.nn.Linear(2, 2), layer)
    assert warm_matmul_tuning(decoder, 24) == 0  # the dense reference (CPU): nothing to tune
    layer.use_backend("triton", torch.float16)  # as materialize chooses it on a GPU
    asked = []
    monkeypatch.setattr(quant_matmul, "choose_config", lambda M, kw, dtype, device: asked.append(M))
    assert warm_matmul_tuning(decoder, 40) == len(asked) == len(set(asked))
    assert {quant_matmul.m_bucket(M) for M in range(1, 41)} == set(asked)  # 1 .. 16 one by one, then 32, 64


def test_model_generate_decodes_with_the_engines_launches(model_dir, prompts):
    """Model.generate runs its steps through the engine's Executor: a decode step makes the
    engine's launches (9 per layer, the block write when a block fills, the split combine when
    attention splits), one host sync (the sampler's read) and one input copy (two when a block
    fills: its block-table row)."""
    from lowbit_testing.counting import generate_step_counts

    model = runtime.load(model_dir, kv=INT4, dtype=torch.bfloat16)
    model.decoder.use_kernels(True)
    model.decoder.attention_kernels = True
    tokens = iter(model.generate(prompts[0], max_new_tokens=16, stop_at_eos=False))  # 5 tokens: block 0 fills
    next(tokens)
    seen = set()
    for position in range(5, 17):
        fills = (position + 1) % 16 == 0
        counts = generate_step_counts(model, tokens)
        combine = counts["ops"].get("triton:_combine_kernel", 0) // counts["layers"]
        assert counts["launches_per_layer"] == [9 + fills + combine] * counts["layers"], counts["ops"]
        assert counts["syncs"] == 1 and counts["input_copies"] == 1 + fills, counts["ops"]
        seen.add(fills)
