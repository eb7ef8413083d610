"""Decode attention's CPU backends (runtime/attention_backends/: cpu-native, the compiled
kernel; cpu-folded, PyTorch ops over the stored codes) equal the reference backend (dequantize the
cache, SDPA) for every scheme they serve: lockstep rows, engine rows at different lengths, sliding
windows, GQA, soft-capping, block boundaries. Tests pick a backend by name; the choice itself
(priority, refusals, LOWBIT_DISABLE, a backend added as one class and one list entry) at the end."""

import pytest
import torch

import runtime.attention_backends as backends
from kvquant import parse_kv
from runtime.attention import SequenceBatch, WholeCache
from runtime.attention_backends import CPU_FOLDED, CPU_NATIVE, REFERENCE, backend_named, case_of, choose_attention
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.cpu_attention import decodes, folds

H, HQ, D = 2, 6, 64
FOLDED = ["int8-r32", "int4-g16-r32", "int4-g32-r64", "int2-g16-r32", "int4-g64-r64", "int2-g64-r64",
          "k8v4-g16-r32", "k4v2-g32-r32", "k2v8-g16-r32"]
TOL = dict(rtol=1e-4, atol=1e-5)  # float32, summation order differs


def twin_caches(cls, spec: str, batch: int, max_len: int, windows=None, dtype=torch.float32):
    """Two caches, to be fed the same keys and values: one for the backend under test, one for the
    reference backend."""
    caches = tuple(cls(1, batch, H, D, max_len, dtype, "cpu", parse_kv(spec), windows=windows) for _ in "ab")
    assert caches[0].folded_decode
    return caches


def runs(name: str, spec: str, dtype=torch.float32, head_dim: int = D):
    """The backend called ``name``, skipping the test where it refuses the case (and saying why)."""
    backend = backend_named(name)
    reason = backend.refuses(case_of(parse_kv(spec), head_dim, dtype, "cpu"))
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return backend


ON_CODES = ["cpu-native", "cpu-folded"]


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


@pytest.mark.parametrize("name", ON_CODES)
@pytest.mark.parametrize("spec, window, softcap", CASES)
def test_lockstep_decode_matches_reference(name, spec, window, softcap, folded_calls):
    backend = runs(name, spec)
    g = torch.Generator().manual_seed(0)
    caches = twin_caches(LockstepCache, spec, 2, 200, None if window is None else [window])
    prompt = 62
    k, v = (torch.randn(2, H, prompt, D, generator=g) * 2 + 0.5 for _ in range(2))
    for cache, b in zip(caches, (backend, REFERENCE)):
        WholeCache(cache, 0, prompt, b).attend(0, torch.randn(2, HQ, prompt, D), k, v, window, softcap)
    for position in range(prompt, prompt + 5):  # a block fills at 64: the residual holds 30, 31, 0, 1, 2
        q = torch.randn(2, HQ, 1, D, generator=g)
        k, v = (torch.randn(2, H, 1, D, generator=g) * 2 for _ in range(2))
        out = [WholeCache(c, position, 1, b).attend(0, q, k, v, window, softcap)
               for c, b in zip(caches, (backend, REFERENCE))]
        torch.testing.assert_close(out[0], out[1], **TOL)
    assert len(folded_calls) == 5  # the backend's steps, not the reference's


@pytest.mark.parametrize("name", ON_CODES)
@pytest.mark.parametrize("spec", ["int8-r32", "int4-g16-r32", "int2-g32-r32", "fp16-r32", "int4-g64-r64"])
@pytest.mark.parametrize("window", [None, 24])
def test_engine_rows_at_different_lengths_match_reference(name, spec, window, folded_calls):
    """The engine's decode: each row at its own length (some shorter than a block, one with none
    stored), one call for all of them, against each row read back alone."""
    backend = runs(name, spec)
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
        for cache, b in zip(caches, (backend, REFERENCE)):
            for slot, start in enumerate(starts):
                cache.reserve(slot, start + 1)
            out.append(SequenceBatch(cache, 0, starts, b).attend(0, q, k, v, window))
            for slot in range(len(lengths)):
                cache.advance(slot, 1)
        torch.testing.assert_close(out[0], out[1], **TOL)
    assert len(folded_calls) == 5  # one call per step for every row


def test_bfloat16_model():
    """A bf16 cache: the folded path computes in float32 and returns bf16, within bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    caches = twin_caches(LockstepCache, "int4-g16-r32", 1, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, H, 90, D, generator=g).bfloat16() for _ in range(2))
    pair = (choose_attention(case_of(parse_kv("int4-g16-r32"), D, torch.bfloat16, "cpu")).backend, REFERENCE)
    assert pair[0] is CPU_FOLDED  # the compiled kernel takes float32 models only
    for cache, b in zip(caches, pair):
        WholeCache(cache, 0, 90, b).attend(0, torch.randn(1, HQ, 90, D).bfloat16(), k, v, None)
    q, k, v = (torch.randn(1, n, 1, D, generator=g).bfloat16() for n in (HQ, H, H))
    out = [WholeCache(c, 90, 1, b).attend(0, q, k, v, None) for c, b in zip(caches, pair)]
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
    whole = CPU_FOLDED.decode(paged, q, lengths)
    monkeypatch.setattr(cpu_attention, "CHUNK_FLOATS", 1)  # one row per chunk
    torch.testing.assert_close(CPU_FOLDED.decode(paged, q, lengths), whole, rtol=0, atol=0)


# ------------------------------------------------- the compiled kernel (runtime/native/kv_attention.cpp)

NATIVE = ["fp16-r32", "int8-r32", "int4-g32-r64", "int4-g64-r64", "int2-g64-r64", "k2v8-g16-r32", "k8v4-g32-r32"]


def native_kernel():
    """The cpu-native backend, skipping where it is switched off or not built here."""
    return runs("cpu-native", "int8-r32")


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
    GQA and soft-capping: equal to the reference backend to float32 rounding."""
    from runtime.kernels.kv_reference import PagedKV

    native = native_kernel()
    lengths = [3, 64, 31, 97, 130, 16]
    paged = PagedKV.from_cache(filled_cache(spec, lengths, window=window), 0)
    q = torch.randn(len(lengths), query_heads, 1, D, generator=torch.Generator().manual_seed(5))
    assert choose_attention(case_of(paged.scheme, D, torch.float32, "cpu")).backend is native
    got = native.decode(paged, q, lengths, window, softcap)
    torch.testing.assert_close(got, REFERENCE.decode(paged, q, lengths, window, softcap), **TOL)


@pytest.mark.parametrize("spec", ["int4-g32-r64", "int8-r32", "fp16-r32"])
def test_native_head_dim_128(spec):
    """Eight chunks of 16 channels a row; int4 g32 values: four channel groups, one per byte chunk."""
    from runtime.kernels.kv_reference import PagedKV

    native = native_kernel()
    lengths = [70, 129]
    paged = PagedKV.from_cache(filled_cache(spec, lengths, head_dim=128), 0)
    q = torch.randn(len(lengths), HQ, 1, 128, generator=torch.Generator().manual_seed(6))
    assert native.refuses(case_of(paged.scheme, 128, torch.float32, "cpu")) is None
    torch.testing.assert_close(native.decode(paged, q, lengths), REFERENCE.decode(paged, q, lengths), **TOL)


@pytest.mark.parametrize("spec", ["int4-g32-r64", "fp16-r32"])
def test_native_rows_on_one_thread_or_two(spec):
    """A call with few (query head x key token) pairs runs its rows on the calling thread, one with
    many splits them over the threads (kv_attention.cpp's kParallelPairs: 6 x 49 pairs here, then
    6 x 5,570 over two threads): the same outputs at 1 and 2 threads, equal to the reference."""
    from runtime.kernels.kv_reference import PagedKV

    native, threads = native_kernel(), torch.get_num_threads()
    for lengths in ([40, 9], [3000, 2500, 70]):
        paged = PagedKV.from_cache(filled_cache(spec, lengths), 0)
        q = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(7))
        outputs = []
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                outputs.append(native.decode(paged, q, lengths))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(outputs[0], outputs[1])  # a row's sums do not depend on which thread ran it
        torch.testing.assert_close(outputs[0], REFERENCE.decode(paged, q, lengths), **TOL)


@pytest.mark.parametrize("spec", ["int4-g32-r64", "fp16-r32"])
def test_native_step_dict_keeps_the_lengths_per_window(spec):
    """A decode step's layers share one dict (``step``): the lengths' tensors are built at the first
    call of each window and reused; the outputs are those of calls without it, bit for bit."""
    from runtime.kernels.kv_reference import PagedKV

    native = native_kernel()
    lengths = [70, 129]
    q = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(8))
    step = {}
    for window in (None, 45, None, 45):
        paged = PagedKV.from_cache(filled_cache(spec, lengths, window=window), 0)
        got = native.decode(paged, q, lengths, window, step=step)
        assert torch.equal(got, native.decode(paged, q, lengths, window)), window
    assert sorted(step, key=str) == [("native bounds", 45), ("native bounds", None)]
    assert step[("native bounds", 45)].tolist() == [lengths, [25, 84]]


def test_which_caches_the_native_kernel_takes():
    """Served: float32 models whose layout the kernel walks; the rest pass it over with the reason,
    to the PyTorch folded path."""
    native_kernel()

    def choice(spec, dtype=torch.float32):
        return choose_attention(case_of(parse_kv(spec), D, dtype, "cpu"))

    for spec in NATIVE:
        assert choice(spec).name == "cpu-native", spec
    # values in groups smaller than a 16-byte chunk of codes; key groups of fewer than 16 tokens
    for spec, why in [("int4-g16-r32", "16-byte chunks"), ("k4v2-g32-r32", "16-byte chunks"),
                      ("int4-g8-r32", "16-token tiles")]:
        chosen = choice(spec)
        assert chosen.name == "cpu-folded" and why in dict((r.name, r.reason) for r in chosen.rejected)["cpu-native"]
    assert "model dtype torch.bfloat16" in choice("int4-g32-r64", torch.bfloat16).explain()
    fp8 = choice("fp8")
    assert fp8.name == "reference" and [r.name for r in fp8.rejected] == ["triton", "cpu-native", "cpu-folded"]


@pytest.mark.parametrize("switch", [{"LOWBIT_NATIVE": "0"}, {"LOWBIT_DISABLE": "cpu-native"},
                                    {"LOWBIT_DISABLE": "native,triton"}, {"LOWBIT_CPU_KERNELS": "0"}])
def test_switches_pass_the_native_kernel_over(switch, monkeypatch):
    """LOWBIT_NATIVE=0, LOWBIT_CPU_KERNELS=0 and LOWBIT_DISABLE (runtime.backend.disabled) switch the
    compiled kernel off by name or group word; a model's next forward chooses again (the switches
    are part of the key)."""
    from runtime.attention import model_attention
    from runtime.model import Decoder, DecoderConfig

    native_kernel()
    decoder = Decoder(DecoderConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)))
    assert model_attention(decoder, parse_kv("int8-r32"), torch.float32, "cpu").name == "cpu-native"
    for name, value in switch.items():
        monkeypatch.setenv(name, value)
    chosen = model_attention(decoder, parse_kv("int8-r32"), torch.float32, "cpu")
    assert chosen.name == "cpu-folded" and "disabled (LOWBIT_DISABLE names" in chosen.explain()


def test_a_backend_asked_for_by_name_that_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="KV cache fp8: the fp8 cache"):
        choose_attention(case_of(parse_kv("fp8"), D, torch.float32, "cpu"), asked="cpu-folded")
    with pytest.raises(ValueError, match="no attention backend named 'sdpa'"):
        choose_attention(case_of(parse_kv("fp8"), D, torch.float32, "cpu"), asked="sdpa")
    assert choose_attention(case_of(parse_kv("int8"), D, torch.float32, "cpu"), asked="reference").name == "reference"


def test_native_refuses_what_it_cannot_read():
    """Lengths past the block table's reach and mismatched layouts are errors, not stray reads."""
    from runtime.kernels.kv_reference import PagedKV

    native = native_kernel()
    paged = PagedKV.from_cache(filled_cache("int4-g32-r64", [70, 40]), 0)
    q = torch.randn(2, HQ, 1, D)
    with pytest.raises(RuntimeError, match="block table's reach"):
        native.decode(paged, q, [70, 10_000])
    with pytest.raises(RuntimeError, match="scales must match"):
        native.decode(paged._replace(v=paged.v._replace(scale=paged.v.scale[:, :, :5])), q, [70, 40])


# ------------------------------------------------- every backend against the reference, per KV family

FAMILIES = ["fp16-r32", "int8-r32", "int4-g32-r64", "int4-g16-r32", "int2-g64-r64", "k8v4-g32-r32", "k4v2-g32-r32",
            "fp8-r32"]


@pytest.mark.parametrize("name", ON_CODES)
@pytest.mark.parametrize("spec", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_cpu_backend_passes_its_self_check(name, spec, dtype):
    """Each backend that takes the case runs its self-check hook (``check``: ragged rows, a window,
    soft-capping) against the reference backend, within runtime.tolerances' bound for the dtype."""
    runs(name, spec, dtype).check(case_of(parse_kv(spec), D, dtype, "cpu", softcap=True))


@pytest.mark.parametrize("spec", FAMILIES)
def test_the_reference_backend_is_the_kernels_reference(spec):
    """The reference backend's decode (read back, SDPA per sequence) equals kv_reference's, the one
    the Triton kernels are tested against, on every family (fp8 included)."""
    from runtime.kernels.kv_reference import PagedKV
    from runtime.kernels.kv_reference import decode_attention as kernels_reference

    lengths = [3, 64, 97]
    paged = PagedKV.from_cache(filled_cache(spec, lengths, window=None), 0)
    q = torch.randn(len(lengths), HQ, 1, D, generator=torch.Generator().manual_seed(9))
    want = kernels_reference(q[:, :, 0], paged, torch.tensor(lengths))[:, :, None]
    torch.testing.assert_close(REFERENCE.decode(paged, q, lengths), want, rtol=0, atol=0)


def test_a_broken_backend_fails_its_self_check():
    """The check can fail: a backend whose output is off by 1% is caught."""
    from runtime.tolerances import Mismatch

    class Off(backends.AttentionBackend):
        name = "off"

        def refuses(self, case):
            return None

        def decode(self, paged, q, lengths, window=None, softcap=None, step=None):
            return CPU_FOLDED.decode(paged, q, lengths, window, softcap) * 1.01

    with pytest.raises(Mismatch, match=r"decode attention \(off\)"):
        Off().check(case_of(parse_kv("int4-g32-r64"), D, torch.float32, "cpu"))


# ------------------------------------------------- one file plus one line: a backend added to the list


class Fake(backends.AttentionBackend):
    """What a new backend is: a name, its refusals, a decode over the paged cache (here the folded
    path's, counted) and, from AttentionBackend, the self-check."""

    name = "fake"
    on_codes = True

    def __init__(self):
        self.calls = 0

    def refuses(self, case):
        return None if case.device == "cpu" and case.scheme.quantized else "a test backend for quantized caches on CPU"

    def decode(self, paged, q, lengths, window=None, softcap=None, step=None):
        self.calls += 1
        return CPU_FOLDED.decode(paged, q, lengths, window, softcap)


def test_a_backend_added_to_the_priority_list_is_chosen_and_runs(monkeypatch):
    """One class and one list entry: the model's forwards and an engine's steps run it, the
    choice names what it passed over, the self-check passes, and unquantized caches it refuses
    go on to the next backend."""
    from runtime.model import Decoder, DecoderConfig

    fake = Fake()
    monkeypatch.setattr(backends, "PRIORITY", [fake, *backends.PRIORITY])
    cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
    torch.manual_seed(0)
    decoder = Decoder(cfg).eval()
    scheme = parse_kv("int4-g16-r16")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    theirs, reference = (LockstepCache(2, 2, 2, cfg.head_dim, 32, torch.float32, "cpu", scheme=scheme) for _ in "ab")
    decoder.attention_asked = "reference"
    with torch.inference_mode():
        want = decoder(ids[:, :20], reference, 0)[:, -1:]
        want = torch.cat([want] + [decoder(ids[:, p:p + 1], reference, p) for p in range(20, 24)], 1)
        decoder.attention_asked = "auto"
        got = decoder(ids[:, :20], theirs, 0)[:, -1:]
        got = torch.cat([got] + [decoder(ids[:, p:p + 1], theirs, p) for p in range(20, 24)], 1)
    assert fake.calls == 4 * cfg.num_layers  # every layer of every decode step (past the residual block)
    torch.testing.assert_close(got, want, **TOL)
    from runtime.attention import model_attention

    assert model_attention(decoder, scheme, torch.float32, "cpu").name == "fake"
    other = model_attention(decoder, parse_kv("fp16-r16"), torch.float32, "cpu")
    assert other.rejected[0].name == "fake" and "quantized caches" in other.rejected[0].reason
    fake.check(case_of(scheme, cfg.head_dim, torch.float32, "cpu"))
