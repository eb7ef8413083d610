"""The CPU decode step's shortcuts (bench/results/cpu/NOTES.md, the per-step overhead): attention
over the residual block alone while every position is still there, and the engine's one write of
a decode step's keys and values, each against the path it short-cuts."""

import pytest
import torch

from kvquant import parse_kv
from runtime.attention import SequenceBatch, WholeCache
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache

H, HQ, D = 2, 6, 64
TOL = dict(rtol=1e-4, atol=1e-5)  # float32, summation order differs


@pytest.fixture
def shortcut_calls(monkeypatch):
    import runtime.attention

    calls = []
    original = runtime.attention.residual_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(runtime.attention, "residual_attention", counted)
    return calls


def filled_caches(spec: str, lengths: list[int], window=None):
    """A cache on the fast path and one on the reference (read back + SDPA per sequence), rows
    holding the same random keys and values."""
    caches = [KVCache(1, len(lengths), H, D, 128, torch.float32, "cpu", parse_kv(spec),
                      windows=None if window is None else [window]) for _ in "ab"]
    caches[1].folded_decode = False
    for cache in caches:
        for slot, n in enumerate(lengths):
            cache.add_sequence(slot)
            k, v = (torch.randn(H, n, D, generator=torch.Generator().manual_seed(slot)) for _ in range(2))
            cache.write_sequence(0, slot, 0, k, v)
            cache.advance(slot, n)
    return caches


@pytest.mark.parametrize("spec", ["fp16-r32", "int4-g16-r32"])
@pytest.mark.parametrize("window, softcap", [(None, None), (24, None), (None, 30.0)])
def test_rows_within_the_residual_match_reference(spec, window, softcap, shortcut_calls):
    """Engine rows at different lengths, all shorter than a block: one masked SDPA over the
    residual views gives the reference's attention; from the first filled block on, the usual path."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9]
    caches = filled_caches(spec, lengths, window)
    for step in range(16):  # the longest row fills its first block (32) at step 14
        starts = [n + step for n in lengths]
        q = torch.randn(len(lengths), HQ, 1, D, generator=g)
        k, v = (torch.randn(len(lengths), H, 1, D, generator=g) for _ in range(2))
        out = []
        for cache in caches:
            for slot, start in enumerate(starts):
                cache.reserve(slot, start + 1)
            out.append(SequenceBatch(cache, 0, starts, False).attend(0, q, k, v, window, softcap))
            for slot in range(len(lengths)):
                cache.advance(slot, 1)
        torch.testing.assert_close(out[0], out[1], **TOL)
    # every step while the longest row is under a block (and its window) took the shortcut
    assert len(shortcut_calls) == (7 if window else 14)


def test_lockstep_rows_within_the_residual_match_reference(shortcut_calls):
    g = torch.Generator().manual_seed(1)
    caches = [LockstepCache(1, 2, H, D, 64, torch.float32, "cpu", parse_kv("fp16-r32")) for _ in "ab"]
    caches[1].folded_decode = False
    k, v = (torch.randn(2, H, 20, D, generator=g) for _ in range(2))
    for cache in caches:
        WholeCache(cache, 0, 20, False).attend(0, torch.randn(2, HQ, 20, D), k, v, None)
    for position in range(20, 36):  # the block fills at 32
        q = torch.randn(2, HQ, 1, D, generator=g)
        k, v = (torch.randn(2, H, 1, D, generator=g) for _ in range(2))
        out = [WholeCache(c, position, 1, False).attend(0, q, k, v, None) for c in caches]
        torch.testing.assert_close(out[0], out[1], **TOL)
    assert len(shortcut_calls) == 11  # positions 20 .. 30: lengths 21 .. 31


@pytest.mark.parametrize("spec", ["fp16-r32", "int8-r32"])
@pytest.mark.parametrize("window", [None, 40])
def test_store_decode_equals_a_store_per_sequence(spec, window):
    """``KVCache.store_decode`` (one write for the rows; rows at the same or different places in
    their blocks; a row filling a block; a sliding layer) leaves the cache as a
    ``store_sequence`` per row does: residuals, pool, block table and lengths."""
    g = torch.Generator().manual_seed(2)
    lengths = [5, 30, 5, 62]
    caches = filled_caches(spec, lengths, window)
    for step in range(4):  # row 1 fills a block at step 1, row 3 at step 1 too (64)
        starts = [n + step for n in lengths]
        k, v = (torch.randn(len(lengths), H, 1, D, generator=g) for _ in range(2))
        for cache in caches:
            for slot, start in enumerate(starts):
                cache.reserve(slot, start + 1)
        caches[0].store_decode(0, 0, starts, k, v)
        for slot, start in enumerate(starts):
            caches[1].store_sequence(0, slot, start, k[slot], v[slot])
        for cache in caches:
            for slot in range(len(lengths)):
                cache.advance(slot, 1)
        a, b = caches
        assert torch.equal(a.residual_k[0], b.residual_k[0]) and torch.equal(a.residual_v[0], b.residual_v[0])
        assert torch.equal(a.block_table, b.block_table) and a.seq_lengths == b.seq_lengths
        for x, y in zip(a.pool.layer(0), b.pool.layer(0)):
            assert all(torch.equal(p, q) for p, q in zip(x, y) if p is not None)


def test_store_decode_refuses_what_store_sequence_refuses():
    cache = filled_caches("fp16-r32", [5, 7])[0]
    k = torch.zeros(2, H, 1, D)
    with pytest.raises(ValueError, match="holds 7 positions"):
        cache.store_decode(0, 0, [5, 6], k, k)
    with pytest.raises(ValueError, match="new keys and values"):
        cache.store_decode(0, 0, [5, 7], torch.zeros(2, H + 1, 1, D), torch.zeros(2, H + 1, 1, D))
    with pytest.raises(ValueError, match="for one of 1 layers"):
        cache.store_decode(1, 0, [5, 7], k, k)
    cache.free_sequence(1)
    with pytest.raises(ValueError, match="holds no sequence"):
        cache.store_decode(0, 0, [5, 7], k, k)


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Mistral, Gemma: words begin with '▁', a decode
    drops its text's first space): a window decoded alone would lose that space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lowbit_testing.tiny_models import TEXT

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=[f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("make", ["byte-level", "metaspace"])
def test_text_stream_pieces_are_the_whole_decode_from_short_windows(make):
    """Streamed pieces join to the whole output's decode (multi-byte characters split over tokens,
    special tokens, random ids), while each push decodes only the ids since the last settled
    point and the ones before them, not the whole output."""
    from runtime.generate import TextStream
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer() if make == "byte-level" else metaspace_tokenizer()
    text = "Anne Elliot walked to Kellynch, ünïcødé 日本語 🎉 and back. " * 6
    g = torch.Generator().manual_seed(3)
    outputs = [tok(text).input_ids, torch.randint(0, len(tok), (300,), generator=g).tolist()]
    for ids in outputs:
        lengths, decode = [], tok.decode
        tok.decode = lambda part, **kw: lengths.append(len(part)) or decode(part, **kw)
        stream = TextStream(tok)
        pieces = [stream.push(ids[:i], i == len(ids)) for i in range(1, len(ids) + 1)]
        del tok.decode
        assert "".join(pieces) == stream.text == tok.decode(ids, skip_special_tokens=True)
        # short windows, not the whole output (which a context of special tokens alone, or a
        # replacement character at the end, still sends back to now and then)
        assert sorted(lengths)[len(lengths) * 9 // 10] < 20 < len(ids)


@pytest.mark.parametrize("make", [lambda: torch.randn(2, 3, 6 * 8), lambda: torch.randn(2, 3, 6, 8),
                                  lambda: torch.randn(2, 3, 7 * 8)[..., 8:],
                                  lambda: torch.randn(2, 6, 3, 8).transpose(1, 2),
                                  lambda: torch.randn(2, 3, 12 * 8)[..., ::2]])
def test_heads_are_the_sliced_and_transposed_heads(make):
    """``attention_math.heads``: each group of heads as slicing, viewing and transposing gives it
    (packed heads: views of ``x`` itself; heads not packed, or a strided last dimension: the same values)."""
    from runtime.attention_math import heads

    x, first = make(), 0
    for view, size in zip(heads(x, (1, 3, 2), 8), (1, 3, 2)):
        want = x.reshape(2, 3, -1)[..., first * 8:(first + size) * 8].reshape(2, 3, size, 8).transpose(1, 2)
        assert torch.equal(view, want) and view.shape == (2, size, 3, 8)
        if x.stride(-1) == 1 and (x.dim() == 3 or x.stride(2) == 8):
            assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        first += size


def test_a_decode_step_works_out_where_to_write_once(monkeypatch):
    """An engine decode step over several layers asks ``KVCache.decode_writes`` once, not once per
    layer, and every layer's keys and values land where a store per sequence puts them."""
    layers, lengths, g = 3, [4, 9, 6], torch.Generator().manual_seed(4)
    caches = [KVCache(layers, len(lengths), H, D, 64, torch.float32, "cpu", parse_kv("fp16-r32")) for _ in "ab"]
    for cache in caches:
        for slot, n in enumerate(lengths):
            cache.add_sequence(slot)
            cache.advance(slot, n)
    asked = []
    original = KVCache.decode_writes
    monkeypatch.setattr(KVCache, "decode_writes", lambda *a, **kw: asked.append(1) or original(*a, **kw))
    batch = SequenceBatch(caches[0], 0, lengths, False)
    for layer in range(layers):
        q = torch.randn(len(lengths), HQ, 1, D, generator=g)
        k, v = (torch.randn(len(lengths), H, 1, D, generator=g) for _ in range(2))
        batch.attend(layer, q, k, v, None)
        for slot, start in enumerate(lengths):
            caches[1].store_sequence(layer, slot, start, k[slot], v[slot])
        assert torch.equal(caches[0].residual_k[layer], caches[1].residual_k[layer])
        assert torch.equal(caches[0].residual_v[layer], caches[1].residual_v[layer])
    assert len(asked) == 1
