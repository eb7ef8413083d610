"""GGUF types: lowbit's byte layouts and dequantization against the gguf package, bit for bit."""

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from quant.gguf import TYPES, GGUFFields, dequantize, fallback, fit_rtn, gguf_type, pack, unpack

ROWS, COLS = 6, 512


def random_fields(name: str, seed: int = 0) -> GGUFFields:
    """Every stored field drawn over its whole range (d finite, of both signs)."""
    t = TYPES[name]
    g = torch.Generator().manual_seed(seed)

    def ints(limits, shape):
        return torch.randint(limits[0], limits[1] + 1, shape, generator=g).to(torch.int8)

    def halves(shape):
        return (torch.randn(shape, generator=g) * 0.01).to(torch.float16)

    blocks, subs = (ROWS, COLS // t.block), (ROWS, COLS // (t.sub_block or t.block))
    return GGUFFields(t, ints(t.code_range, (ROWS, COLS)), halves(blocks),
                      None if t.symmetric else halves(blocks),
                      ints(t.scale_range, subs) if t.scale_range else None,
                      ints(t.min_range, subs) if t.min_range else None).check()


def same_fields(a: GGUFFields, b: GGUFFields) -> bool:
    return a.type == b.type and all(
        (getattr(a, k) is None and getattr(b, k) is None) or torch.equal(getattr(a, k), getattr(b, k))
        for k in ("codes", "d", "dmin", "scales", "mins"))


@pytest.mark.parametrize("name", list(TYPES))
def test_layout_matches_gguf_dequantize_bit_for_bit(name):
    fields = random_fields(name)
    data = pack(fields)
    t = TYPES[name]
    assert data.shape == (ROWS, COLS // t.block * t.block_bytes) and data.dtype == np.uint8
    theirs = gguf.quants.dequantize(data, t.ggml_type)
    ours = dequantize(fields).numpy()
    assert theirs.shape == (ROWS, COLS)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert same_fields(unpack(name, data, (ROWS, COLS)), fields)


@pytest.mark.parametrize("name", list(TYPES))
def test_any_stored_bytes_round_trip(name):
    # every byte pattern is a valid block of these types: unpack then pack gives the same bytes back
    t = TYPES[name]
    data = np.random.default_rng(1).integers(0, 256, (ROWS, t.row_bytes(COLS)), dtype=np.uint8)
    assert np.array_equal(pack(unpack(name, data, (ROWS, COLS))), data)
    assert np.array_equal(pack(unpack(name, data.tobytes(), (ROWS, COLS))), data)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_reads_what_gguf_quantizes(name):
    w = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32)
    data = gguf.quants.quantize(w, TYPES[name].ggml_type)
    fields = unpack(name, data, (ROWS, COLS))
    np.testing.assert_array_equal(dequantize(fields).numpy(), gguf.quants.dequantize(data, TYPES[name].ggml_type))


# plain RTN's relative RMS error on Gaussian weights: each type's grid, as coarse as its bits
RTN_ERROR = {"Q2_K": 0.40, "Q3_K": 0.20, "Q4_0": 0.12, "Q4_1": 0.10, "Q5_0": 0.06, "Q5_1": 0.05, "Q4_K": 0.10, "Q5_K": 0.05,
             "Q6_K": 0.025, "Q8_0": 0.008}


@pytest.mark.parametrize("name", list(TYPES))
def test_fit_rtn_is_nearest_on_its_own_grid(name):
    torch.manual_seed(3)
    w = torch.randn(ROWS, COLS) * 0.02
    w[0, :256] = 0  # an all-zero super-block stays exactly zero
    fields = fit_rtn(w, name)
    back = dequantize(fields)
    assert torch.equal(back[0, :256], torch.zeros(256))
    err = ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt()
    assert err < RTN_ERROR[name], err
    # rounding to nearest: moving any code one step is never closer (for codes inside the range)
    t = fields.type
    for delta in (-1, 1):
        moved = fields.codes.int() + delta
        inside = (moved >= t.code_range[0]) & (moved <= t.code_range[1])
        other = GGUFFields(t, moved.clamp(*t.code_range).to(torch.int8), fields.d, fields.dmin, fields.scales,
                           fields.mins)
        worse = (dequantize(other) - w).abs() >= (back - w).abs() - 1e-7
        assert bool(worse[inside].all())


def test_type_table():
    assert gguf_type("q4_k") is TYPES["Q4_K"]
    # bits per weight as llama.cpp documents them
    assert {n: t.bits_per_weight for n, t in TYPES.items()} == {
        "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5,
        "Q6_K": 6.5625}
    with pytest.raises(ValueError, match="unknown GGUF type 'Q7_K'.*Q4_0"):
        gguf_type("Q7_K")


def test_bad_fields_are_named():
    fields = random_fields("Q4_K")
    fields.scales[0, 0] = 64
    with pytest.raises(ValueError, match=r"Q4_K scales must lie in \[0, 63\]"):
        pack(fields)
    with pytest.raises(ValueError, match="blocks of 256"):
        fit_rtn(torch.zeros(4, 96), "Q6_K")
    with pytest.raises(ValueError, match="takes .* bytes"):
        unpack("Q8_0", b"\0" * 33, (1, 32))
    with pytest.raises(ValueError, match="Q4_0 stores no dmin"):
        GGUFFields(TYPES["Q4_0"], torch.zeros(1, 32, dtype=torch.int8), torch.zeros(1, 1, dtype=torch.float16),
                   torch.zeros(1, 1, dtype=torch.float16)).check()


def test_small_rows_fall_back_as_llama_cpp():
    assert fallback("Q4_K", 512) is TYPES["Q4_K"]
    assert [fallback(t, 576).name for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")] == [
        "Q4_0", "Q4_0", "Q5_0", "Q5_1", "Q8_0"]
    with pytest.raises(ValueError, match="a row of 48 columns fits neither Q4_0"):
        fallback("Q4_0", 48)
