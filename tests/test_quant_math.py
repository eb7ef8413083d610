"""Properties of the shared affine math and bit packing, over bits, groups and shapes."""

import pytest
import torch

from quant.affine import QuantScheme, choose_qparams, dequantize, fake_quantize, fit_group_size, quantize
from quant.packing import pack, packed_length, unpack

BITS = (2, 3, 4, 8)
SHAPES = [(1, 32), (7, 64), (16, 96), (3, 576), (33, 200)]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 31), (4, 32), (9, 33), (12, 577)])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_roundtrip(bits, shape, dim):
    g = torch.Generator().manual_seed(hash((bits, shape, dim)) % 2**31)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, dtype=torch.int8, generator=g)
    packed = pack(q, bits, dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == packed_length(shape[dim], bits)
    assert torch.equal(unpack(packed, bits, shape[dim], dim), q)


@pytest.mark.parametrize("bits", [2, 4, 8])  # 3-bit layouts differ between compressed-tensors releases
def test_pack_is_byte_compatible_with_compressed_tensors(bits):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (24, 200), dtype=torch.int8)
    for dim in (0, 1):
        assert torch.equal(pack(q, bits, dim), helpers.pack_to_int32(q, bits, dim))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_sit_at_their_bits_of_the_little_endian_stream(bits):
    # The layout written out (2, 4 and 8 bits pack byte by byte): element i at bits [i*bits, (i+1)*bits)
    # of the row's stream, stored as q + 2**(bits-1), the row padded to whole words.
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (3, 45), dtype=torch.int8, generator=g)
    for row_q, row_words in zip(q.tolist(), pack(q, bits).tolist()):
        stream = sum((v + (1 << (bits - 1))) << (bits * i) for i, v in enumerate(row_q))
        assert [w & 0xFFFFFFFF for w in row_words] == [(stream >> (32 * w)) & 0xFFFFFFFF
                                                        for w in range(packed_length(45, bits))]
    for strided in (q.t(), q.t().contiguous()):  # along dim 0, from a transposed view or a copy
        assert torch.equal(pack(strided, bits, 0), pack(q, bits).t())
        assert torch.equal(unpack(pack(q, bits).t(), bits, 45, 0), strided)


def test_three_bit_values_straddle_words_densely():
    # The dense layout of compressed-tensors >= 0.19: element i at bits [3i, 3i+3) of the stream.
    u = [(5 * i + 3) % 8 for i in range(11)]
    stream = sum(v << (3 * i) for i, v in enumerate(u))
    words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(2)]
    expected = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)
    q = torch.tensor([u], dtype=torch.int8) - 4
    assert torch.equal(pack(q, 3), expected)


def test_pack_rejects_wrong_types():
    with pytest.raises(TypeError):
        pack(torch.zeros(2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="need"):
        unpack(torch.zeros(2, 3, dtype=torch.int32), 4, 8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [-1, 16, 32])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_error_is_at_most_half_a_step(bits, group, symmetric, shape):
    if group != -1 and shape[1] % group:
        pytest.skip("width not divisible by group")
    scheme = QuantScheme(bits, group, symmetric)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits * 100 + shape[0])) * 0.05
    scale, zero = choose_qparams(x, scheme)
    q = quantize(x, scale, zero, scheme)
    assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax
    assert (zero is None) == symmetric
    err = (dequantize(q, scale, zero, scheme, torch.float32) - x).abs()
    step = scale.repeat_interleave(scheme.group_len(shape[1]), dim=-1)
    assert (err <= step / 2 * (1 + 1e-4) + 1e-9).all()


def test_asymmetric_zero_is_exact_and_handles_one_signed_rows():
    scheme = QuantScheme(4, 32, symmetric=False)
    x = torch.rand(4, 64) + 0.5  # all positive: the range is stretched to include zero
    x[0, 3] = 0.0
    x[1] = 0.0  # a constant row must not divide by zero
    y = fake_quantize(x, scheme)
    assert torch.isfinite(y).all()
    assert y[0, 3] == 0 and (y[1] == 0).all()


def test_more_bits_means_less_error():
    x = torch.randn(64, 256)
    errors = [(fake_quantize(x, QuantScheme(b, 64)) - x).norm() for b in BITS]
    assert all(a > b for a, b in zip(errors, errors[1:]))


def test_smaller_groups_mean_less_error():
    x = torch.randn(64, 256) * torch.linspace(0.1, 3, 256)  # channel outliers: what groups are for
    errors = [(fake_quantize(x, QuantScheme(4, g)) - x).norm() for g in (-1, 128, 32)]
    assert errors[0] > errors[1] > errors[2]


def test_dequantize_keeps_leading_dims():
    scheme = QuantScheme(4, 16)
    x = torch.randn(2, 3, 64)
    scale, zero = choose_qparams(x, scheme)
    assert scale.shape == (2, 3, 4)
    assert dequantize(quantize(x, scale, zero, scheme), scale, zero, scheme).shape == x.shape


@pytest.mark.parametrize(
    "columns, group, expected",
    [(576, 64, 64), (576, 128, 96), (1536, 128, 128), (577, 128, -1), (100, -1, -1), (48, 64, 48)],
)
def test_fit_group_size(columns, group, expected):
    assert fit_group_size(columns, group) == expected


def test_scheme_validation():
    with pytest.raises(ValueError, match="bits"):
        QuantScheme(bits=5)
    with pytest.raises(ValueError, match="group_size"):
        QuantScheme(group_size=0)
    with pytest.raises(ValueError, match="do not split"):
        QuantScheme(4, 64).num_groups(100)
