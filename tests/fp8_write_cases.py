"""FP8 quantize-on-write on the values where float8 e4m3 converters disagree, checked byte for byte
against kvquant on the CPU (torch's ``.to(torch.float8_e4m3fn)``): used by
tests/test_kernels_attention.py in process, and run as a script under each Triton release CI has:

    python tests/fp8_write_cases.py     # prints {"float16": {...}, "float32": {...}} mismatch counts

The script runs the kernel in the Triton interpreter of the python that runs it, so under
``.venv-triton36`` it sees that release's front end: there ``-x`` is ``0 - x``, which makes +0 out
of a -0 (the first H200 run's fp8 write mismatches), while Triton 3.9's ``-x`` keeps the sign.

Head 0 has amax 448, so its scale is exactly 1 and every value reaches the cast as written: signed
zeros, negative values that round to zero, exact ties between e4m3 codes (ties to even, the
subnormal ones, those that carry into the next power of two, the last below 448) and, in float32,
values one ulp past a tie (a conversion through float16 first would round them onto the tie and
then to the wrong side). Head 1's amax is one whose scale ``amax / 448`` differs from
``amax * (1 / 448)`` (PyTorch's division by a scalar on CUDA), so the scale's division form shows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # a child process: the interpreter, before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

B, D = 32, 64  # one block of one sequence, head_dim 64
# exact ties between neighbouring e4m3 codes, as multiples of 2**-10: 0 | 2**-9, 2 | 3 (x 2**-9),
# 7 x 2**-9 | 2**-6 (subnormal into normal), then 1 | 1.125, 1.125 | 1.25, 1.875 | 2, 15 | 16,
# 384 | 416, 416 | 448
TIES = [2.0**-10, 5 * 2.0**-10, 15 * 2.0**-10, 1.0625, 1.1875, 1.9375, 15.5, 400.0, 432.0]
TINY = [2.0**-12, 2.0**-11, 3 * 2.0**-12]  # below half the smallest subnormal: they round to (signed) zero


def head_amax_with_inexact_scalar_division() -> float:
    """The first float16 value from 3.0 up whose ``x / 448`` and ``x * RN(1/448)`` differ in float32."""
    x = torch.arange(torch.tensor(3.0, dtype=torch.float16).view(torch.int16).item(), 0x7000, dtype=torch.int32)
    x = x.to(torch.int16).view(torch.float16).float()
    differs = (x / 448.0) != x * torch.tensor(1 / 448.0, dtype=torch.float32)
    return float(x[differs][0])


def crafted_block(dtype: torch.dtype) -> torch.Tensor:
    """New keys or values [1 sequence, 2 heads, B, D] of ``dtype``."""
    x = torch.randn(1, 2, B, D, generator=torch.Generator().manual_seed(5)).clamp(-3, 3)
    x[0, 0] *= 100.0  # head 0 spans the whole e4m3 range (scale 1)
    special = [448.0, -448.0, 0.0, -0.0, *TINY, *(-t for t in TINY), *TIES, *(-t for t in TIES)]
    if dtype == torch.float32:  # one float32 ulp either side of each tie: not float16 values
        up = [float(torch.nextafter(torch.tensor(t), torch.tensor(1e9))) for t in TIES]
        down = [float(torch.nextafter(torch.tensor(t), torch.tensor(0.0))) for t in TIES]
        special += up + down + [-v for v in up + down]
    flat = x[0, 0].reshape(-1)
    flat[: len(special)] = torch.tensor(special)
    amax = head_amax_with_inexact_scalar_division()
    x[0, 1, 0, 0] = amax  # head 1: that amax (the rest of the head is within +-3)
    return x.to(dtype)


def mismatches(device, dtype: torch.dtype) -> dict:
    """Write one full block (keys and values: the same crafted data) with the Triton kernel on
    ``device`` and with kvquant's reference writer on the CPU; the bytes and scales that differ."""
    from kvquant import parse_kv
    from runtime.cache import KVCache
    from runtime.kernels import attention as kernels
    from runtime.kernels import kv_reference as ref
    from runtime.kernels.kv_reference import PagedKV

    caches = [KVCache(1, 1, 2, D, 2 * B, dtype, dev, scheme=parse_kv(f"fp8-r{B}")) for dev in (device, "cpu")]
    for cache in caches:
        cache.block_table.copy_(torch.arange(cache.block_table.numel()).view_as(cache.block_table))
    got, want = (PagedKV.from_cache(c, 0) for c in caches)
    x = crafted_block(dtype)
    kernels.write_kv(got, torch.zeros(1, dtype=torch.int32, device=device), x.to(device), x.to(device))
    ref.write_kv(want, torch.zeros(1, dtype=torch.int32), x, x)
    out = {}
    for name, a, b in (("keys", got.k, want.k), ("values", got.v, want.v)):
        codes_a, codes_b = a.data.cpu().view(torch.uint8), b.data.view(torch.uint8)
        wrong = (codes_a != codes_b).nonzero().tolist()
        out[name] = {"codes": len(wrong), "scales": int((a.scale.cpu() != b.scale).sum()),
                     "first": [[*i, int(codes_a[tuple(i)]), int(codes_b[tuple(i)])] for i in wrong[:4]]}
    return out


if __name__ == "__main__":
    import triton

    print(json.dumps({"triton": triton.__version__,
                      **{str(dt).removeprefix("torch."): mismatches("cpu", dt) for dt in (torch.float16, torch.float32)}}))
