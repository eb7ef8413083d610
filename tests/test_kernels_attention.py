"""The Triton KV-cache attention kernels (runtime/kernels/attention.py) against their PyTorch
references (runtime/kernels/kv_reference.py, built on kvquant), in the Triton interpreter on CPU
tensors where there is no GPU (compiled on CUDA tensors where there is one).

What the interpreter checks: the paged layout walk (block table, residual, per-sequence lengths),
unpacking and dequantization, GQA row mapping, the online softmax, the split-and-combine, the
quantize-on-write math bit for bit, the two-launch write order. What it cannot: speed (see
bench/attention.py), compiled code generation (register layouts, ``tl.dot`` on tensor cores),
bfloat16 (raw uint16 in the interpreter: its ``tl.dot`` multiplies integers, so bf16 is not
tested here). No fp32 -> fp8 cast is involved: the writer builds the e4m3 bytes itself; what a
Triton release's front end makes of its arithmetic (3.6's ``-x`` is ``0 - x``) is checked by
running tests/fp8_write_cases.py in each release's interpreter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kernel_device import DEVICE  # first: it picks the interpreter without a GPU

import fp8_write_cases
from bench.correctness import same_cache
from kvquant import KVScheme, parse_kv, quantize_kv
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.kernels import attention as kernels
from runtime.kernels import kv_reference as ref
from runtime.kernels.kv_reference import PagedKV
from runtime.attention import attention_mask

B = 32  # block (residual) size of the small test caches; KIVI groups of 16 tokens / channels
SCHEMES = ["fp16-r32", "int8-r32", "int4-g16-r32", "int2-g16-r32", "fp8-r32"]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float16, offset_channels: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=generator(seed))
    if offset_channels:  # keys as LLMs make them: a few channels with a large persistent offset
        x[..., :: max(shape[-1] // 4, 1)] += 6.0
    return x.to(dtype).to(DEVICE)


def empty_paged(scheme: KVScheme, seqs: int, heads: int, dim: int, max_len: int, dtype=torch.float16,
                seed: int = 0) -> PagedKV:
    """A cache layer whose blocks are all allocated, scattered over the pool (paging, not a ramp)."""
    cache = KVCache(1, seqs, heads, dim, max_len, dtype, DEVICE, scheme=scheme)
    n = cache.block_table.numel()
    cache.block_table.copy_(torch.randperm(n, generator=generator(seed)).view_as(cache.block_table))
    return PagedKV.from_cache(cache, 0)


def on_cpu(p: PagedKV) -> PagedKV:
    """A CPU copy: kvquant on the CPU is the truth the writer must match bit for bit (PyTorch on CUDA
    divides by a Python scalar through its reciprocal, which can move a scale's last bit)."""
    copy = lambda q: q.map(lambda t: t.cpu().clone())  # noqa: E731
    return PagedKV(copy(p.k), copy(p.v), p.residual_k.cpu().clone(), p.residual_v.cpu().clone(),
                   p.block_table.cpu().clone(), p.scheme)


def fill(p: PagedKV, lens: list[int], seed: int) -> None:
    """Write ``lens[s]`` random positions into sequence s (reference writer, one sequence at a time)."""
    H, D = p.residual_k.shape[1], p.residual_k.shape[3]
    for s, n in enumerate(lens):
        one = PagedKV(p.k, p.v, p.residual_k[s:s + 1], p.residual_v[s:s + 1], p.block_table[s:s + 1], p.scheme)
        k = randn(1, H, n, D, seed=seed + 2 * s, dtype=p.dtype, offset_channels=True)
        v = randn(1, H, n, D, seed=seed + 2 * s + 1, dtype=p.dtype)
        ref.write_kv(one, torch.zeros(1, dtype=torch.int32, device=DEVICE), k, v)


def lengths(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def assert_same_cache(actual: PagedKV, expected: PagedKV) -> None:
    assert same_cache(actual, expected)  # bench/correctness.py: gpu_check's write check, the same rule


# ------------------------------------------------------------------------------ quantize-on-write


@pytest.mark.parametrize("name", SCHEMES)
def test_write_is_bit_identical_to_the_reference(name):
    scheme = parse_kv(name)
    S, H, D = 3, 2, 64
    paged = empty_paged(scheme, S, H, D, max_len=4 * B, seed=1)
    # an empty sequence, one shorter than a block, one with a residual one token from full
    fill(paged, [0, 5, B - 1], seed=10)
    starts = [0, 5, B - 1]
    for step, T in enumerate((1, 40, 3)):  # a decode step (fills seq 2's block), a prefill chunk, a few more
        k = randn(S, H, T, D, seed=100 + step, offset_channels=True)
        v = randn(S, H, T, D, seed=200 + step)
        expected, actual = on_cpu(paged), paged
        ref.write_kv(expected, torch.tensor(starts, dtype=torch.int32), k.cpu(), v.cpu())
        kernels.write_kv(actual, lengths(starts), k, v)
        assert_same_cache(actual, expected)
        starts = [s + T for s in starts]


NO_MISMATCH = {"codes": 0, "scales": 0, "first": []}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_write_keeps_signed_zeros_ties_and_single_rounding(dtype):
    """Signed zeros, ties between e4m3 codes (subnormal, carrying into the next power of two, next
    to 448), float32 values one ulp off a tie (a detour through float16 rounds them wrongly), a
    scale that ``amax * (1/448)`` would miss: byte for byte torch's ``.to(torch.float8_e4m3fn)``."""
    result = fp8_write_cases.mismatches(DEVICE, dtype)
    assert result == {"keys": NO_MISMATCH, "values": NO_MISMATCH}


def test_fp8_write_matches_torch_under_each_triton_release(triton_release):
    """The same cases in the interpreter of the other Triton releases CI has (3.6: the lent GPU's,
    whose ``-x`` is ``0 - x``: before the writer set the sign bit itself, -0 came out +0 there, the
    first H200 run's 4 failed fp8 cases)."""
    if triton_release.python == sys.executable:
        pytest.skip("this venv's Triton: the test above")
    run = triton_release.run([Path(__file__).with_name("fp8_write_cases.py")], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["triton"] == triton_release.version
    for dtype in ("float16", "float32"):
        assert result[dtype] == {"keys": NO_MISMATCH, "values": NO_MISMATCH}, (dtype, result[dtype])


@pytest.mark.parametrize("name", ["int8-r32", "int4-g16-r32", "int2-g16-r32"])
def test_written_blocks_equal_kvquant_quantize_kv(name):
    """Tie the kernel straight to kvquant: a prefill of 2 blocks + 7 positions, head_dim 128."""
    scheme = parse_kv(name)
    paged = empty_paged(scheme, 1, 1, 128, max_len=3 * B, seed=2)
    k = randn(1, 1, 2 * B + 7, 128, seed=3, offset_channels=True)
    v = randn(1, 1, 2 * B + 7, 128, seed=4)
    kernels.write_kv(paged, lengths([0]), k, v)
    for j in range(2):
        block = paged.block_table[0, j].long()
        for keys, x in ((True, k), (False, v)):
            want = quantize_kv(x[0, :, j * B:(j + 1) * B].cpu(), scheme, keys)  # [H, ...]
            for stored, expected in zip(paged.pool(keys), want):
                assert torch.equal(stored[block].cpu(), expected)
    assert torch.equal(paged.residual_k[0, :, :7], k[0, :, 2 * B:])
    assert torch.equal(paged.residual_v[0, :, :7], v[0, :, 2 * B:])


# ------------------------------------------------------------------------------- decode attention

MIXED_LENGTHS = [7, B, 2 * B - 1, 2 * B + 13]  # < a block, empty residual, full residual, uneven


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("name", SCHEMES)
def test_decode_attention_matches_the_reference(name, gqa, dim):
    scheme = parse_kv(name)
    S, H = len(MIXED_LENGTHS), 2
    paged = empty_paged(scheme, S, H, dim, max_len=3 * B, seed=gqa)
    fill(paged, MIXED_LENGTHS, seed=dim + gqa)
    q = randn(S, H * gqa, dim, seed=7)
    lens = lengths(MIXED_LENGTHS)
    want = ref.decode_attention(q, paged, lens)
    got = kernels.decode_attention(q, paged, lens)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_attention_splits_and_sliding_window(splits, window):
    scheme = parse_kv("int4-g16-r32")
    lens = [0, 3, 2 * B + 13, 4 * B]  # an idle slot (zeros), and splits that hold nothing
    paged = empty_paged(scheme, len(lens), 1, 64, max_len=4 * B, seed=5)
    fill(paged, lens, seed=50)
    q = randn(len(lens), 4, 64, seed=8)
    want = ref.decode_attention(q, paged, lengths(lens), window=window)
    got = kernels.decode_attention(q, paged, lengths(lens), window=window, num_splits=splits)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


class _LaunchSpy:
    """Stands in for a kernel: records what each launch would pass and runs nothing."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_a_growing_context_reuses_one_compiled_kernel(monkeypatch):
    """Eager decode sizes the split from the context bound; every compile-time input (constexprs,
    and ints Triton would specialize) must stay the same as the context grows, or each new split
    count costs a fresh compile. The split count and blocks per split are runtime arguments."""
    scheme = parse_kv("int4-g16-r32")
    paged = empty_paged(scheme, 2, 2, 64, max_len=64 * B)
    q = randn(2, 8, 64, seed=1)
    interpreted = kernels.interpreting()
    decode, combine = _LaunchSpy(kernels._decode_kernel), _LaunchSpy(kernels._combine_kernel)
    monkeypatch.setattr(kernels, "_decode_kernel", decode)
    monkeypatch.setattr(kernels, "_combine_kernel", combine)
    for bound in (1, B + 1, 5 * B, 17 * B + 3, 64 * B):
        kernels.decode_attention(q, paged, lengths([bound, bound]), max_seq_len=bound)
    splits = [grid[2] for grid, _, _ in decode.launches]
    assert len(set(splits)) >= 3, splits  # the bound did move the split count ...
    assert all(kw == decode.launches[0][2] for _, _, kw in decode.launches)  # ... and no constexpr
    assert all(kw == combine.launches[0][2] for _, _, kw in combine.launches)
    for spy, names in ((decode, ("blocks_per_split", "splits")), (combine, ("splits",))):
        jit = spy.kernel
        skip = (jit.kwargs.get("do_not_specialize", []) if interpreted
                else [p.name for p in jit.params if p.do_not_specialize])
        assert set(names) <= set(skip), (names, skip)
    # the length-following values reach the kernel as plain arguments
    assert {args[-1] for _, args, _ in decode.launches} == set(splits)


@pytest.mark.parametrize("window", [None, 21])
def test_decode_attention_tiles_within_a_key_group(window):
    """INT4 with key groups wider than the tile (32 tokens, 16-token tiles): the folded kernel
    scales the query once per group and walks the group's tiles; 4 value groups per head
    (dequantized, not folded), head_dim 128, splits that start mid-sequence."""
    scheme = parse_kv("int4-g32-r64")
    lens = [5, 64 + 31, 3 * 64, 2 * 64 + 40]
    paged = empty_paged(scheme, len(lens), 2, 128, max_len=3 * 64, seed=15)
    fill(paged, lens, seed=90)
    q = randn(len(lens), 8, 128, seed=91)
    want = ref.decode_attention(q, paged, lengths(lens), window=window)
    got = kernels.decode_attention(q, paged, lengths(lens), window=window, tile=16, num_splits=2)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_decode_attention_in_float32():
    scheme = parse_kv("int8-r32")
    paged = empty_paged(scheme, 2, 2, 64, max_len=2 * B, dtype=torch.float32, seed=6)
    fill(paged, [B + 9, 17], seed=60)
    q = randn(2, 8, 64, seed=9, dtype=torch.float32)
    want = ref.decode_attention(q, paged, lengths([B + 9, 17]))
    torch.testing.assert_close(kernels.decode_attention(q, paged, lengths([B + 9, 17])), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["int8-r32", "int4-g16-r32", "fp8-r32"])
def test_dequantize_cache_is_bit_identical(name):
    paged = empty_paged(parse_kv(name), 3, 2, 64, max_len=3 * B, seed=11)
    lens = [2 * B + 5, B, 9]
    fill(paged, lens, seed=70)
    for length in (2 * B + 5, B + 3):  # the whole cache, and a cut through a sequence
        want = ref.dequantize_cache(paged, lengths(lens), length)
        got = kernels.dequantize_cache(paged, lengths(lens), length)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------- the cache's attention


@pytest.mark.parametrize("name", ["int4-g16-r32", "int8-r32"])
def test_cache_attention_through_prefill_chunks_and_decode(name):
    """The runtime's GPU path (kernels) against the same path on the references, and its decode
    steps against the CPU path (cache.update + SDPA), on one cache history."""
    scheme = parse_kv(name)
    S, H, Hq, D, max_len = 2, 2, 8, 64, 3 * B
    fused, reference = (LockstepCache(1, S, H, D, max_len, torch.float16, DEVICE, scheme=scheme) for _ in range(2))
    cpu_path = LockstepCache(1, S, H, D, max_len, torch.float16, "cpu", scheme=scheme)
    pos, step = 0, 0
    for T in (40, 13) + (1,) * 14:  # a prefill, a chunk that reads the first from the cache, decode over 64
        q = randn(S, Hq, T, D, seed=300 + step)
        k = randn(S, H, T, D, seed=400 + step, offset_channels=True)
        v = randn(S, H, T, D, seed=500 + step)
        mask = attention_mask(T, pos + T, None, DEVICE)
        got = kernels.cache_attention(fused, 0, pos, q, k, v, mask)
        want = ref.cache_attention(reference, 0, pos, q, k, v, mask)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        keys, values = cpu_path.update(0, pos, k.cpu(), v.cpu())
        if T == 1:
            plain = torch.nn.functional.scaled_dot_product_attention(q.cpu(), keys, values, enable_gqa=True)
            torch.testing.assert_close(got.cpu(), plain, atol=2e-3, rtol=2e-3)
        pos, step = pos + T, step + 1
    assert fused.lengths == reference.lengths == [pos]
    assert torch.equal(fused.block_table.cpu(), cpu_path.block_table)
    assert_same_cache(PagedKV.from_cache(fused, 0), PagedKV.from_cache(cpu_path, 0))


def test_unsupported_caches_fall_back_or_fail_clearly():
    odd = parse_kv("int4-g16-r48")  # a block of 48 tokens: not a power of two
    cache = LockstepCache(1, 1, 1, 64, 96, torch.float16, DEVICE, scheme=odd)
    q, k = randn(1, 1, 1, 64, seed=1), randn(1, 1, 1, 64, seed=2)
    assert kernels.cache_attention(cache, 0, 0, q, k, k) is None  # the model then takes cache.update + SDPA
    with pytest.raises(ValueError, match="block size .*48"):
        kernels.decode_attention(q[:, :, 0], PagedKV.from_cache(cache, 0), lengths([1]))
    paged = empty_paged(parse_kv("int4-g16-r32"), 2, 2, 64, max_len=B)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        kernels.decode_attention(randn(2, 3, 64, seed=3), paged, lengths([1, 1]))
    with pytest.raises(ValueError, match=r"\[S=2, H=2, T, D=64\]"):
        kernels.write_kv(paged, lengths([0, 0]), randn(2, 2, 1, 32, seed=4), randn(2, 2, 1, 32, seed=5))


def test_ties_round_half_to_even_like_torch_round():
    """Exact halves on the grid: scale 1 and zero 0 (a token spanning -128..127 at 8 bits), the
    other channels at k + 0.5. Rounding half up would move every odd k + 0.5 one step."""
    scheme = parse_kv("int8-r32")
    x = torch.randint(-120, 120, (1, 1, B, 64), generator=generator(12)).float() + 0.5
    x[..., 0], x[..., 1] = -128.0, 127.0
    paged = empty_paged(scheme, 1, 1, 64, max_len=B)
    kernels.write_kv(paged, lengths([0]), x.half().to(DEVICE), x.half().to(DEVICE))
    want = quantize_kv(x[0, :, :].half(), scheme, keys=True)
    assert float(want.scale.float().unique()) == 1.0 and float(want.zero.float().abs().max()) == 0.0
    block = paged.block_table[0, 0].long()
    assert torch.equal(paged.k.data[block].cpu(), want.data)


def test_a_value_group_as_wide_as_the_head():
    """int4 with group 64 on head_dim 64 (SmolLM2's shape): one value group per token, 64-token tiles."""
    scheme = parse_kv("int4-g64-r64")
    lens = [64 + 17, 30]
    paged = empty_paged(scheme, 2, 1, 64, max_len=2 * 64, seed=13)
    expected = on_cpu(paged)
    k = randn(2, 1, 64 + 17, 64, seed=81, offset_channels=True)
    v = randn(2, 1, 64 + 17, 64, seed=82)
    kernels.write_kv(paged, lengths([0, 0]), k, v)
    ref.write_kv(expected, torch.zeros(2, dtype=torch.int32), k.cpu(), v.cpu())
    assert_same_cache(paged, expected)
    q = randn(2, 3, 64, seed=83)
    torch.testing.assert_close(kernels.decode_attention(q, paged, lengths(lens)),
                               ref.decode_attention(q, paged, lengths(lens)), atol=2e-3, rtol=2e-3)


def test_cache_attention_with_a_sliding_window():
    scheme = parse_kv("int8-r32")
    S, H, Hq, D, window = 1, 1, 4, 64, 24
    fused, reference = (LockstepCache(1, S, H, D, 2 * B, torch.float16, DEVICE, scheme=scheme) for _ in range(2))
    pos = 0
    for step, T in enumerate((40, 1, 1, 1)):
        q = randn(S, Hq, T, D, seed=600 + step)
        k = randn(S, H, T, D, seed=700 + step, offset_channels=True)
        v = randn(S, H, T, D, seed=800 + step)
        mask = attention_mask(T, pos + T, window, DEVICE)
        got = kernels.cache_attention(fused, 0, pos, q, k, v, mask, window)
        want = ref.cache_attention(reference, 0, pos, q, k, v, mask, window)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        pos += T


def test_kernels_compile_for_a_hopper_gpu(triton_release):
    """Lower the kernels through Triton's CUDA backend and ptxas for sm_90 without a GPU, under
    each Triton release CI has (the lent GPU machine's too): the interpreter never generates code,
    so this is what catches compiler-only errors (and bf16)."""
    run = triton_release.run([Path(__file__).with_name("attention_compile_check.py"), "90", "--quick"], timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("compiled") == 2 * 5, run.stdout


@pytest.mark.parametrize("family", [{"model_type": "llama"}, {"model_type": "mistral", "sliding_window": 12}],
                         ids=["llama", "mistral-window"])
def test_the_models_kernel_backend_matches_its_reference_backend(monkeypatch, family):
    """The attention backend is the decoder's, chosen once per cache scheme (``Decoder.attention``;
    here picked by name). On ``triton`` every layer's attention runs the kernels over one shared
    cache (mask, window, layer index); decoding token by token, it must give the ``reference``
    backend's logits (Mistral: a sliding window the 20 tokens outgrow)."""
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, **family))
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    scheme = parse_kv("int4-g16-r16")
    ids = torch.randint(0, 64, (2, 20), generator=generator(14))
    plain, fused = (LockstepCache(2, 2, 1, cfg.head_dim, 32, torch.float32, "cpu", scheme=scheme) for _ in range(2))
    calls = []
    spy = ref.AttentionOps(kernels.write_kv, kernels.dequantize_cache,
                           lambda *a, **k: calls.append(1) or kernels.decode_attention(*a, **k))
    monkeypatch.setattr(kernels, "KERNEL_OPS", spy)
    want, got = [], []
    with torch.inference_mode():
        for pos in range(20):  # crosses a block boundary: 16 tokens fill and quantize one
            model.attention_asked = "reference"  # backends picked by name
            want.append(model(ids[:, pos:pos + 1], plain, pos))
            model.attention_asked = "triton"
            got.append(model(ids[:, pos:pos + 1], fused, pos))
    assert len(calls) == 20 * cfg.num_layers
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-4, rtol=1e-4)
