"""KV-cache quantization: the schemes, the shared quantize/dequantize, the runtime's paged cache."""

from __future__ import annotations

import pytest
import torch

from kvquant import (KVScheme, bytes_per_token, dequantize_blocks, dequantize_kv, fake_quantize_kv, layout, parse_kv,
                     quantize_blocks, quantize_kv)
from quant.affine import QuantScheme, choose_qparams, dequantize, quantize
from quant.packing import unpack
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from lowbit_testing.kv_data import keys_with_offset_channels, rel_err

SCHEMES = ["fp16", "int8", "int4", "int2", "fp8"]




# ------------------------------------------------------------------ affine math


def test_float_zero_spans_the_groups_own_range():
    x = torch.tensor([[5.0, 5.5, 6.0, 7.0]])  # far from zero, as a key channel's offset
    grid = QuantScheme(bits=2, group_size=4)
    scale, zero = choose_qparams(x, grid, scale_dtype=torch.float16, float_zero=True)
    assert zero.dtype == torch.float16
    assert float(scale) == pytest.approx(2.0 / 3, rel=1e-3)  # (7 - 5) over 3 steps, not (7 - 0)
    y = dequantize(quantize(x, scale, zero, grid), scale, zero, grid, torch.float32)
    assert y.min() == pytest.approx(5.0, abs=1e-2) and y.max() == pytest.approx(7.0, abs=1e-2)
    # Weights keep integer zeros inside the range: the same group loses much more there.
    s_int, z_int = choose_qparams(x, grid)
    y_int = dequantize(quantize(x, s_int, z_int, grid), s_int, z_int, grid, torch.float32)
    assert (y - x).abs().max() < 0.5 * (y_int - x).abs().max()


def test_float_zero_of_a_constant_group_stays_finite_in_float16():
    x = torch.full((1, 64), 300.0)
    scale, zero = choose_qparams(x, QuantScheme(bits=4, group_size=64), scale_dtype=torch.float16, float_zero=True)
    assert torch.isfinite(zero).all() and torch.isfinite(scale).all()
    y = dequantize(quantize(x, scale, zero, QuantScheme(4, 64)), scale, zero, QuantScheme(4, 64), torch.float32)
    torch.testing.assert_close(y, x, rtol=2e-3, atol=0)


def test_float_zero_clip_shrinks_about_the_centre():
    """A range ratio below 1 narrows the grid around the group's middle (not towards zero, where
    an offset key channel would lose its whole range), and clamps only the extremes."""
    x = torch.tensor([[10.0, 10.5, 11.0, 11.5, 12.0, 14.0]])
    grid = QuantScheme(bits=2, group_size=6)
    scale, zero = choose_qparams(x, grid, 0.5, scale_dtype=torch.float32, float_zero=True)
    y = dequantize(quantize(x, scale, zero, grid), scale, zero, grid, torch.float32)
    assert float(y.min()) == pytest.approx(11.0, abs=1e-4) and float(y.max()) == pytest.approx(13.0, abs=1e-4)


def test_int2_range_ratio_rounds_gaussian_values_finer(monkeypatch):
    """INT2's four levels spend less on the extremes: lower error for the bulk of the values."""
    from kvquant.schemes import kivi

    scheme = parse_kv("int2")
    assert scheme.range_ratio(keys=False) < 1.0 and parse_kv("int4").range_ratio(keys=False) == 1.0
    x = torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(0))
    clipped = rel_err(fake_quantize_kv(x, scheme, keys=False), x)
    monkeypatch.setitem(kivi.RANGE_RATIO, 2, (1.0, 1.0))
    assert clipped < 0.97 * rel_err(fake_quantize_kv(x, scheme, keys=False), x)


# ---------------------------------------------------------------- schemes


def test_scheme_names_round_trip():
    assert parse_kv("int4") == KVScheme(bits=4, group_size=64, residual=128)
    assert parse_kv("int4-g32-r64") == KVScheme(bits=4, group_size=32, residual=64)
    assert parse_kv("FP8") == KVScheme(bits=8, type="float")
    assert parse_kv("fp16") == KVScheme() and not KVScheme().quantized
    for name in ("int8", "fp8", "fp16", "int2-g32-r128"):
        assert parse_kv(name).name == name


@pytest.mark.parametrize("bits", [3, 1, 32, True])
def test_bits_outside_the_supported_set_are_refused(bits):
    with pytest.raises(ValueError, match=r"bits must be one of 16, 8, 4, 2 \(16 = unquantized\)"):
        KVScheme(bits=bits)
    with pytest.raises(ValueError, match="unknown KV cache scheme"):
        parse_kv("int3")


def test_a_group_that_does_not_divide_head_dim_says_why():
    with pytest.raises(ValueError, match=r"group_size 64 does not divide head_dim 96.*cannot reach into the next head.*e\.g\. 32"):
        KVScheme(bits=4).check_head_dim(96)
    with pytest.raises(ValueError, match="group_size 64 does not divide head_dim 96"):
        KVCache(1, 1, 2, 96, 256, torch.float32, "cpu", scheme=KVScheme(bits=2))
    KVScheme(bits=8).check_head_dim(96)  # per-token INT8 has no channel groups


def test_residual_must_hold_whole_key_groups():
    with pytest.raises(ValueError, match="residual 100 is not a multiple of group_size 64"):
        KVScheme(bits=4, residual=100)
    with pytest.raises(ValueError, match="bits must be 8"):
        KVScheme(bits=4, type="float")


# ------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("keys", [True, False])
def test_quantized_tensors_follow_the_documented_layout(name, keys):
    scheme = parse_kv(name)
    x = keys_with_offset_channels(2, 3)
    q = quantize_kv(x, scheme, keys)
    for (part, (shape, dtype)), tensor in zip(layout(scheme, 64, torch.float32, keys).items(), q):
        assert tuple(tensor.shape) == (2, 3, *shape), part
        assert tensor.dtype == dtype, part
    parts = len(layout(scheme, 64, torch.float32, keys))
    assert all(t is None for t in q[parts:])  # fp16 has no scale, fp8 no zero


@pytest.mark.parametrize("name, bound", [("fp16", 0.0), ("int8", 0.01), ("fp8", 0.06), ("int4", 0.12), ("int2", 0.6)])
def test_round_trip_error_shrinks_with_bits(name, bound):
    x = keys_with_offset_channels(4, 2, seed=3)
    for keys in (True, False):
        assert rel_err(fake_quantize_kv(x, parse_kv(name), keys), x) <= bound


def test_int_data_is_the_affine_grid_packed_per_token():
    # One source of truth: unpacking the stored words gives quant.affine's integers.
    scheme = parse_kv("int4")
    v = torch.randn(3, 128, 64)
    data, scale, zero = quantize_kv(v, scheme, keys=False)
    grid = QuantScheme(bits=4, group_size=64)
    s, z = choose_qparams(v, grid, scale_dtype=torch.float16, float_zero=True)
    q = unpack(data.reshape(-1, data.shape[-1]), 4, 64).reshape(3, 128, 64)
    assert torch.equal(q, quantize(v, s, z, grid))
    torch.testing.assert_close(dequantize_kv((data, scale, zero), scheme, False, 64, torch.float32),
                               dequantize(q, s, z, grid, torch.float32))


def affine_values(qx, scheme, keys: bool, dtype) -> torch.Tensor:
    """``(q - zero) * scale`` in float32, each scale and zero repeated over its group, then ``dtype``:
    the documented layout written out by hand (FP8: ``data * scale``)."""
    if scheme.fp8:
        return (qx.data.float() * qx.scale).to(dtype)
    data, scale, zero = qx
    q = unpack(data.reshape(-1, data.shape[-1]), scheme.bits, 64).reshape(*data.shape[:-1], 64)
    if keys and scheme.kivi:  # one per channel and group of G tokens
        scale, zero = (t.float().repeat_interleave(scheme.group_size, -2) for t in (scale, zero))
    else:  # one per token and group of channels (INT8: the whole head)
        scale, zero = (t.float().repeat_interleave(64 // t.shape[-1], -1) for t in (scale, zero))
    return ((q.float() - zero) * scale).to(dtype)


@pytest.mark.parametrize("name", ["int8", "int4-g32", "int2-g16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_a_buffer_view_gives_exactly_the_affine_values(name, dtype):
    # The runtime cache dequantizes straight into its read buffer through strided, block-major views;
    # the values must be the layout's, bit for bit, there and in a new tensor.
    scheme = parse_kv(name)
    x = keys_with_offset_channels(3, 2, tokens=64, seed=4)  # [blocks, heads, tokens, channels]
    for keys in (True, False):
        qx = quantize_kv(x, scheme, keys)
        want = affine_values(qx, scheme, keys, dtype)
        buffer = torch.full((2, 3 * 64 + 5, 64), float("nan"), dtype=dtype)  # [heads, positions, channels]
        view = buffer[:, :192].unflatten(1, (3, 64)).transpose(0, 1)
        dequantize_kv(qx, scheme, keys, 64, dtype, out=view)
        assert torch.equal(view, want) and torch.equal(dequantize_kv(qx, scheme, keys, 64, dtype), want)
        assert buffer[:, 192:].isnan().all()  # nothing written past the view


def test_per_channel_keys_beat_per_token_keys():
    # Why KIVI groups keys per channel: offset channels ruin a per-token grid.
    x = keys_with_offset_channels(4, 2, seed=5)
    scheme = parse_kv("int4")
    per_channel = fake_quantize_kv(x, scheme, keys=True)
    per_token = fake_quantize_kv(x, scheme, keys=False)
    assert rel_err(per_channel, x) < 0.5 * rel_err(per_token, x)


def test_int4_costs_under_a_third_of_fp16_per_token():
    fp16 = bytes_per_token(parse_kv("fp16"), 30, 3, 64)
    assert fp16 == 30 * 3 * 64 * 2 * 2
    assert bytes_per_token(parse_kv("int4"), 30, 3, 64) / fp16 == pytest.approx((64 + 8) / 256)
    assert bytes_per_token(parse_kv("int8"), 30, 3, 64) / fp16 == pytest.approx((128 + 8) / 256)


# ------------------------------------------------------------ runtime cache


def write_in_chunks(cache, layer, k, v, sizes):
    pos = 0
    for size in sizes:
        keys, values = cache.update(layer, pos, k[:, :, pos:pos + size], v[:, :, pos:pos + size])
        pos += size
    return keys, values


@pytest.mark.parametrize("name", SCHEMES)
def test_cache_holds_full_blocks_quantized_and_the_partial_block_exact(name):
    base = parse_kv(name)
    scheme = KVScheme(bits=base.bits, type=base.type, group_size=32, residual=64)
    k = keys_with_offset_channels(2, 3, tokens=150, seed=1)
    v = torch.randn(2, 3, 150, 64)
    cache = LockstepCache(2, 2, 3, 64, 160, torch.float32, "cpu", scheme=scheme)
    write_in_chunks(cache, 1, k, v, [50, 1, 1, 30, 3, 65])  # blocks fill mid-chunk
    keys, values = cache.read(1, 150)
    assert keys.shape == values.shape == (2, 3, 150, 64)
    # Positions 0..127 sit in two quantized blocks, each quantized on its own; 128..149 are exact.
    for b in range(2):
        span = slice(64 * b, 64 * (b + 1))
        torch.testing.assert_close(keys[:, :, span], fake_quantize_kv(k[:, :, span], scheme, True))
        torch.testing.assert_close(values[:, :, span], fake_quantize_kv(v[:, :, span], scheme, False))
    assert torch.equal(keys[:, :, 128:], k[:, :, 128:]) and torch.equal(values[:, :, 128:], v[:, :, 128:])
    assert cache.block_table[:, :2].min() >= 0 and (cache.block_table[:, 2:] == -1).all()
    k_part, _ = cache.read(1, 100)  # a prefix ending inside a quantized block
    torch.testing.assert_close(k_part, keys[:, :, :100])


def test_a_chunk_reads_its_own_tokens_fresh_and_a_decode_step_reads_the_cache():
    scheme = parse_kv("int4-g32-r64")
    cache = LockstepCache(1, 1, 2, 64, 200, torch.float32, "cpu", scheme=scheme)
    k, v = keys_with_offset_channels(1, 2, tokens=200, seed=2), torch.randn(1, 2, 200, 64)
    write_in_chunks(cache, 0, k, v, [40])
    keys, values = cache.update(0, 40, k[:, :, 40:100], v[:, :, 40:100])  # fills block 0 mid-chunk
    stored_k, stored_v = cache.read(0, 100)
    assert torch.equal(keys[:, :, :40], stored_k[:, :, :40]) and not torch.equal(stored_k[:, :, :40], k[:, :, :40])
    assert torch.equal(keys[:, :, 40:], k[:, :, 40:100]) and torch.equal(values[:, :, 40:], v[:, :, 40:100])
    for pos in range(100, 128):  # decode up to the fill of block 1: each step reads the cache as stored
        keys, _ = cache.update(0, pos, k[:, :, pos:pos + 1], v[:, :, pos:pos + 1])
        assert torch.equal(keys, cache.read(0, pos + 1)[0])
    torch.testing.assert_close(keys[:, :, 64:128], fake_quantize_kv(k[:, :, 64:128], scheme, True))


@pytest.mark.parametrize("name", ["fp16", "int8", "int4-g32", "fp8"])
def test_both_caches_read_exactly_what_their_blocks_dequantize_to(name):
    # The rule of runtime/cache.py, bit for bit: a position in a filled block reads as that block
    # quantized and dequantized; a later one, and a chunk's own tokens, read as written.
    scheme = parse_kv(f"{name}-r64")
    k, v = keys_with_offset_channels(2, 3, tokens=150, seed=1), torch.randn(2, 3, 150, 64)
    stored = [dequantize_blocks(quantize_blocks(x[:, :, :128], scheme, keys), scheme, keys, 64, torch.float32)
              for x, keys in ((k, True), (v, False))]
    lockstep = LockstepCache(1, 2, 3, 64, 160, torch.float32, "cpu", scheme=scheme)
    slots = KVCache(1, 2, 3, 64, 160, torch.float32, "cpu", scheme=scheme)
    for s in range(2):
        slots.add_sequence()
    pos = 0
    for size in [50, 1, 30, 40, 1, 3, 25]:  # chunks across block boundaries, decode steps
        end = pos + size
        read = [lockstep.update(0, pos, k[:, :, pos:end], v[:, :, pos:end])]
        per_slot = [slots.write_sequence(0, s, pos, k[s, :, pos:end], v[s, :, pos:end]) for s in range(2)]
        read.append(tuple(torch.stack(t) for t in zip(*per_slot)))
        for s in range(2):
            slots.advance(s, size)
        as_stored = min(end // 64 * 64, end if size == 1 else pos)  # a chunk reads itself fresh
        for got, x, want in zip((t for pair in read for t in pair), (k, v) * 2, stored * 2):
            assert torch.equal(got[:, :, :as_stored], want[:, :, :as_stored])
            assert torch.equal(got[:, :, as_stored:], x[:, :, as_stored:end])
        pos = end


def test_block_table_is_shared_by_layers_and_blocks_are_paged_from_one_pool():
    scheme = parse_kv("int4-g32-r32")
    cache = LockstepCache(2, 2, 1, 64, 96, torch.float32, "cpu", scheme=scheme, num_blocks=5)
    x = torch.randn(2, 1, 64, 64)
    for layer in range(2):
        cache.update(layer, 0, x, x)
    assert sorted(cache.block_table[:, :2].flatten().tolist()) == [0, 1, 2, 3]  # two sequences, two blocks each
    with pytest.raises(RuntimeError, match="pool is full: 5 blocks of 32 tokens, 2 more needed"):
        cache.update(0, 64, x[:, :, :32], x[:, :, :32])
    cache.reset()
    assert (cache.block_table == -1).all() and cache.lengths == [0, 0]
    cache.update(0, 0, x[:, :, :32], x[:, :, :32])


def test_a_cache_shared_across_models_of_different_shapes_is_refused():
    cache = LockstepCache(2, 1, 3, 64, 256, torch.float32, "cpu", scheme=parse_kv("int4"))
    with pytest.raises(ValueError, match="built for 2 layers of 3 KV heads x head_dim 64.*different shapes"):
        cache.update(0, 0, torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64))  # 2 heads
    with pytest.raises(ValueError, match="different shapes"):
        cache.update(0, 0, torch.randn(1, 3, 4, 32), torch.randn(1, 3, 4, 32))  # head_dim 32
    with pytest.raises(ValueError, match="different shapes"):
        cache.update(2, 0, torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64))  # a third layer
    with pytest.raises(ValueError, match="new ones must follow them"):
        cache.update(0, 5, torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64))


@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "int2", "fp8"])
def test_allocated_bytes_match_the_computed_bytes_per_token(name):
    scheme = parse_kv(name)
    layers, seqs, heads, dim, max_len = 3, 2, 2, 64, 1024
    cache = KVCache(layers, seqs, heads, dim, max_len, torch.float16, "cpu", scheme=scheme)
    residual = 2 * layers * seqs * heads * scheme.residual * dim * 2
    table = cache.block_table.numel() * 4
    per_token = bytes_per_token(scheme, layers, heads, dim, torch.float16)
    assert cache.nbytes() == per_token * seqs * max_len + residual + table
