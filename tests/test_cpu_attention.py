"""Decode attention over the stored codes (runtime.cpu_attention) equals the reference path
(dequantize the cache, SDPA) for every scheme it serves: lockstep rows, engine rows at different
lengths, sliding windows, GQA, soft-capping, block boundaries."""

import pytest
import torch

from kvquant import parse_kv
from runtime.attention import SequenceBatch, WholeCache
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.cpu_attention import decode_attention, decodes, folds

H, HQ, D = 2, 6, 64
FOLDED = ["int8-r32", "int4-g16-r32", "int4-g32-r64", "int2-g16-r32", "int4-g64-r64", "int2-g64-r64",
          "k8v4-g16-r32", "k4v2-g32-r32", "k2v8-g16-r32"]
TOL = dict(rtol=1e-4, atol=1e-5)  # float32, summation order differs


def twin_caches(cls, spec: str, batch: int, max_len: int, windows=None, dtype=torch.float32):
    """A cache on the folded path and one on the reference, to be fed the same keys and values."""
    folded, reference = (cls(1, batch, H, D, max_len, dtype, "cpu", parse_kv(spec), windows=windows) for _ in "ab")
    assert folded.folded_decode
    reference.folded_decode = False
    return folded, reference


@pytest.fixture
def folded_calls(monkeypatch):
    """Counts the decode steps that took the folded path, or while every position is still in the
    residual block its SDPA shortcut (so a test cannot pass by comparing the reference with itself)."""
    import runtime.attention

    calls = []

    def counting(f):
        def counted(*args, **kwargs):
            calls.append(f.__name__)
            return f(*args, **kwargs)
        return counted

    for name in ("decode_attention", "residual_attention"):
        monkeypatch.setattr(runtime.attention, name, counting(getattr(runtime.attention, name)))
    return calls


CASES = [(spec, None, None) for spec in FOLDED + ["fp16-r32"]] + [
    ("int8-r32", 40, None), ("int4-g16-r32", 40, None), ("k4v2-g32-r32", 40, None), ("fp16-r32", 40, None),  # window
    ("int4-g32-r64", None, 30.0), ("int2-g16-r32", None, 30.0), ("fp16-r32", None, 30.0)]  # Gemma 2's soft-capping


@pytest.mark.parametrize("spec, window, softcap", CASES)
def test_lockstep_decode_matches_reference(spec, window, softcap, folded_calls):
    g = torch.Generator().manual_seed(0)
    caches = twin_caches(LockstepCache, spec, 2, 200, None if window is None else [window])
    prompt = 62
    k, v = (torch.randn(2, H, prompt, D, generator=g) * 2 + 0.5 for _ in range(2))
    for cache in caches:
        WholeCache(cache, 0, prompt, False).attend(0, torch.randn(2, HQ, prompt, D), k, v, window, softcap)
    for position in range(prompt, prompt + 5):  # a block fills at 64: the residual holds 30, 31, 0, 1, 2
        q = torch.randn(2, HQ, 1, D, generator=g)
        k, v = (torch.randn(2, H, 1, D, generator=g) * 2 for _ in range(2))
        out = [WholeCache(c, position, 1, False).attend(0, q, k, v, window, softcap) for c in caches]
        torch.testing.assert_close(out[0], out[1], **TOL)
    assert len(folded_calls) == 5  # the folded cache's steps, not the reference's


@pytest.mark.parametrize("spec", ["int8-r32", "int4-g16-r32", "int2-g32-r32", "fp16-r32"])
@pytest.mark.parametrize("window", [None, 24])
def test_engine_rows_at_different_lengths_match_reference(spec, window, folded_calls):
    """The engine's decode: each row at its own length (some shorter than a block, one with none
    stored), one call for all of them, against each row read back alone."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 62, 31, 95]
    caches = twin_caches(KVCache, spec, len(lengths), 160, None if window is None else [window])
    for cache in caches:
        for slot, n in enumerate(lengths):
            cache.add_sequence(slot)
            k, v = (torch.randn(H, n, D, generator=torch.Generator().manual_seed(slot)) for _ in range(2))
            cache.write_sequence(0, slot, 0, k, v)
            cache.advance(slot, n)
    for step in range(5):  # blocks fill at 32, 64, 96
        starts = [n + step for n in lengths]
        q = torch.randn(len(lengths), HQ, 1, D, generator=g)
        k, v = (torch.randn(len(lengths), H, 1, D, generator=g) for _ in range(2))
        out = []
        for cache in caches:
            for slot, start in enumerate(starts):
                cache.reserve(slot, start + 1)
            out.append(SequenceBatch(cache, 0, starts, False).attend(0, q, k, v, window))
            for slot in range(len(lengths)):
                cache.advance(slot, 1)
        torch.testing.assert_close(out[0], out[1], **TOL)
    assert len(folded_calls) == 5  # one call per step for every row


def test_bfloat16_model():
    """A bf16 cache: the folded path computes in float32 and returns bf16, within bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    caches = twin_caches(LockstepCache, "int4-g16-r32", 1, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, H, 90, D, generator=g).bfloat16() for _ in range(2))
    for cache in caches:
        WholeCache(cache, 0, 90, False).attend(0, torch.randn(1, HQ, 90, D).bfloat16(), k, v, None)
    q, k, v = (torch.randn(1, n, 1, D, generator=g).bfloat16() for n in (HQ, H, H))
    out = [WholeCache(c, 90, 1, False).attend(0, q, k, v, None) for c in caches]
    assert out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], out[1], rtol=2e-2, atol=2e-2)


def test_which_schemes_fold():
    assert all(folds(parse_kv(s), D) for s in FOLDED)
    assert not folds(parse_kv("fp16"), D)
    assert not folds(parse_kv("fp8"), D)
    assert not LockstepCache(1, 1, H, D, 64, torch.float32, "cpu", parse_kv("fp8")).folded_decode
    # the unquantized cache's floats are read as stored, every row in one call
    assert decodes(parse_kv("fp16"), D) and not decodes(parse_kv("fp8"), D)
    assert LockstepCache(1, 1, H, D, 64, torch.float32, "cpu", parse_kv("fp16")).folded_decode


@pytest.mark.parametrize("spec", ["int4-g16-r32", "k8v4-g16-r32", "int4-g32-r64", "fp16-r32"])
def test_rows_in_chunks_match_one_chunk(spec, monkeypatch):
    """Rows (KV head x sequence) attended a few at a time (runtime.cpu_attention.CHUNK_FLOATS: the
    float codes stay in cache) give what one chunk of every row gives."""
    import runtime.cpu_attention as cpu_attention

    g = torch.Generator().manual_seed(3)
    lengths = [70, 5, 130]
    cache = KVCache(1, len(lengths), H, D, 200, torch.float32, "cpu", parse_kv(spec))
    for slot, n in enumerate(lengths):
        cache.add_sequence(slot)
        cache.write_sequence(0, slot, 0, *(torch.randn(H, n, D, generator=g) for _ in range(2)))
        cache.advance(slot, n)
    q = torch.randn(len(lengths), HQ, 1, D, generator=g)
    from runtime.kernels.kv_reference import PagedKV

    paged = PagedKV.from_cache(cache, 0)
    whole = decode_attention(paged, q, lengths)
    monkeypatch.setattr(cpu_attention, "CHUNK_FLOATS", 1)  # one row per chunk
    torch.testing.assert_close(decode_attention(paged, q, lengths), whole, rtol=0, atol=0)


# ------------------------------------------------- the compiled kernel (runtime/native/kv_attention.cpp)

NATIVE = ["fp16-r32", "int8-r32", "int4-g32-r64", "int4-g64-r64", "int2-g64-r64", "k2v8-g16-r32", "k8v4-g32-r32"]


def native_kernel():
    from runtime import native

    kernel = native.load("kv_attention")
    if kernel is None:
        pytest.skip("native kernels are off (LOWBIT_NATIVE=0) or cannot be built here (no compiler or ninja)")
    return kernel


def filled_cache(spec: str, lengths: list[int], head_dim: int = D, window=None, seed: int = 4) -> KVCache:
    """An engine cache whose rows hold ``lengths`` positions of random keys and values (offset
    channels, as keys have)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, len(lengths), H, head_dim, max(lengths) + 8, torch.float32, "cpu", parse_kv(spec),
                    windows=None if window is None else [window])
    for slot, n in enumerate(lengths):
        cache.add_sequence(slot)
        k, v = (torch.randn(H, n, head_dim, generator=g) * 2 + torch.randn(1, 1, head_dim, generator=g)
                for _ in range(2))
        cache.write_sequence(0, slot, 0, k, v)
        cache.advance(slot, n)
    return cache


@pytest.mark.parametrize("spec", NATIVE)
@pytest.mark.parametrize("window, softcap", [(None, None), (45, None), (None, 30.0)])
@pytest.mark.parametrize("query_heads", [HQ, 5 * H])  # 3 and 5 query heads per KV head (past 4: two passes)
def test_native_matches_reference(spec, window, softcap, query_heads):
    """The kernel reads pages through the block table at ragged lengths (inside the first 16-token
    tile, a block boundary, the residual alone, 16-token tails), with a window starting mid-tile,
    GQA and soft-capping: equal to dequantize + SDPA (or, with soft-capping, to the PyTorch
    folded path) to float32 rounding."""
    from runtime.cpu_attention import _native_attention, _native_kernel
    from runtime.kernels.kv_reference import PagedKV
    from runtime.kernels.kv_reference import decode_attention as reference

    kernel = native_kernel()
    lengths = [3, 64, 31, 97, 130, 16]
    paged = PagedKV.from_cache(filled_cache(spec, lengths, window=window), 0)
    q = torch.randn(len(lengths), query_heads, 1, D, generator=torch.Generator().manual_seed(5))
    assert _native_kernel(paged, q) is kernel
    got = _native_attention(kernel, paged, q, lengths, window, softcap)
    if softcap is None:
        expected = reference(q[:, :, 0], paged, torch.tensor(lengths), window)[:, :, None]
    else:
        import runtime.cpu_attention as cpu_attention

        with pytest.MonkeyPatch.context() as m:
            m.setattr(cpu_attention, "_native_kernel", lambda *_: None)
            expected = decode_attention(paged, q, lengths, window, softcap)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("spec", ["int4-g32-r64", "int8-r32", "fp16-r32"])
def test_native_head_dim_128(spec):
    """Eight chunks of 16 channels a row; int4 g32 values: four channel groups, one per byte chunk."""
    from runtime.cpu_attention import _native_attention, _native_kernel
    from runtime.kernels.kv_reference import PagedKV
    from runtime.kernels.kv_reference import decode_attention as reference

    kernel = native_kernel()
    lengths = [70, 129]
    paged = PagedKV.from_cache(filled_cache(spec, lengths, head_dim=128), 0)
    q = torch.randn(len(lengths), HQ, 1, 128, generator=torch.Generator().manual_seed(6))
    assert _native_kernel(paged, q) is kernel
    expected = reference(q[:, :, 0], paged, torch.tensor(lengths))[:, :, None]
    torch.testing.assert_close(_native_attention(kernel, paged, q, lengths, None, None), expected, **TOL)


@pytest.mark.parametrize("spec", ["int4-g32-r64", "fp16-r32"])
def test_native_rows_on_one_thread_or_two(spec):
    """A call with few (query head x key token) pairs runs its rows on the calling thread, one with
    many splits them over the threads (kv_attention.cpp's kParallelPairs: 6 x 49 pairs here, then
    6 x 5,570 over two threads): the same outputs at 1 and 2 threads, equal to the reference."""
    from runtime.cpu_attention import _native_attention
    from runtime.kernels.kv_reference import PagedKV
    from runtime.kernels.kv_reference import decode_attention as reference

    kernel, threads = native_kernel(), torch.get_num_threads()
    for lengths in ([40, 9], [3000, 2500, 70]):
        paged = PagedKV.from_cache(filled_cache(spec, lengths), 0)
        q = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(7))
        outputs = []
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                outputs.append(_native_attention(kernel, paged, q, lengths, None, None))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(outputs[0], outputs[1])  # a row's sums do not depend on which thread ran it
        torch.testing.assert_close(outputs[0], reference(q[:, :, 0], paged, torch.tensor(lengths))[:, :, None], **TOL)


@pytest.mark.parametrize("spec", ["int4-g32-r64", "fp16-r32"])
def test_native_step_dict_keeps_the_lengths_per_window(spec):
    """A decode step's layers share one dict (``step``): the lengths' tensors are built at the first
    call of each window and reused; the outputs are those of calls without it, bit for bit."""
    from runtime.kernels.kv_reference import PagedKV

    native_kernel()
    lengths = [70, 129]
    q = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(8))
    step = {}
    for window in (None, 45, None, 45):
        paged = PagedKV.from_cache(filled_cache(spec, lengths, window=window), 0)
        got = decode_attention(paged, q, lengths, window, step=step)
        assert torch.equal(got, decode_attention(paged, q, lengths, window)), window
    assert sorted(step, key=str) == [("native bounds", 45), ("native bounds", None)]
    assert step[("native bounds", 45)].tolist() == [lengths, [25, 84]]


def test_which_calls_take_the_native_kernel(monkeypatch):
    """Served: float32 models whose layout the kernel walks; the rest keep the PyTorch path, as
    everything does with LOWBIT_NATIVE=0."""
    from runtime.cpu_attention import _native_kernel
    from runtime.kernels.kv_reference import PagedKV

    native_kernel()
    q = torch.randn(1, HQ, 1, D)
    for spec in NATIVE:
        assert _native_kernel(PagedKV.from_cache(filled_cache(spec, [40]), 0), q) is not None, spec
    # values in groups smaller than a 16-byte chunk of codes; key groups of fewer than 16 tokens
    for spec in ["int4-g16-r32", "k4v2-g32-r32", "int4-g8-r32"]:
        assert _native_kernel(PagedKV.from_cache(filled_cache(spec, [40]), 0), q) is None, spec
    bf16 = KVCache(1, 1, H, D, 64, torch.bfloat16, "cpu", parse_kv("int4-g32-r64"))
    assert _native_kernel(PagedKV.from_cache(bf16, 0), q.bfloat16()) is None
    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    assert _native_kernel(PagedKV.from_cache(filled_cache("int8-r32", [40]), 0), q) is None


def test_native_refuses_what_it_cannot_read():
    """Lengths past the block table's reach and mismatched layouts are errors, not stray reads."""
    from runtime.cpu_attention import _native_attention
    from runtime.kernels.kv_reference import PagedKV

    kernel = native_kernel()
    paged = PagedKV.from_cache(filled_cache("int4-g32-r64", [70, 40]), 0)
    q = torch.randn(2, HQ, 1, D)
    with pytest.raises(RuntimeError, match="block table's reach"):
        _native_attention(kernel, paged, q, [70, 10_000], None, None)
    with pytest.raises(RuntimeError, match="scales must match"):
        _native_attention(kernel, paged._replace(v=paged.v._replace(scale=paged.v.scale[:, :, :5])), q, [70, 40],
                          None, None)
