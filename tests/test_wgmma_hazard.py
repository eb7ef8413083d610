"""Triton issue 9433's register hazard (bench/wgmma_hazard.py): the SASS walk on hand-written SASS,
the walk on the real kernel (Triton 3.6's hazardous form seen, the newest release's not), and every
tl.dot launch the tuner may choose on sm_90 under Triton 3.6 free of it. Each runs in a child
process: bench/sass.py unsets TRITON_INTERPRET on import, which the suite's own process needs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# One loop iteration: dequantize into R88..R91, one register-A wgmma (closing its group), a wait
# that leaves WAIT groups in flight, the backward branch; then the epilogue's wait-all and store.
LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R88, R2, 0xf, RZ, 0xc0, !PT ;
        /*0020*/                   IMAD.MOV.U32 R89, RZ, RZ, R3 ;
        /*0030*/                   MOV R90, R4 ;
        /*0040*/              @P1  MOV R91, R5 ;
        /*0050*/                   WARPGROUP.ARRIVE ;
        /*0060*/                   HGMMA.64x128x16.F32 R24, R88, gdesc[UR16], R24, gsb0 ;
        /*0070*/                   {EXTRA} ;
        /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, {WAIT} ;
        /*0090*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00a0*/                   ISETP.GE.AND P0, PT, R2, R6, PT ;
        /*00b0*/              @!P0 BRA 0x10 ;
        /*00c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00d0*/                   STG.E [R8.64], R24 ;
        /*00e0*/                   EXIT ;
"""


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def walk(tmp_path, texts: list[str], rounds: int = 3) -> list[dict]:
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"case{i}.sass")
        files[-1].write_text(text)
    run = subprocess.run([sys.executable, "-m", "bench.wgmma_hazard", "--rounds", str(rounds), "--sass", *files],
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def loop(wait: str, extra: str = "NOP") -> str:
    return LOOP.replace("{WAIT}", wait).replace("{EXTRA}", extra)


def test_the_walk_flags_writes_to_a_registers_of_wgmmas_in_flight(tmp_path):
    one_left, all_retired, one_round, acc_read, predicated_wait = walk(tmp_path, [
        loop("0x1"), loop("0x0"), loop("0x1"), loop("0x0", "FADD R30, R24, R25"),
        loop("0x1").replace("WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P2 WARPGROUP.DEPBAR.LE gsb0, 0x0")])
    # the next iteration's four writes to R88..R91 (the predicated one too) while the wgmma reads them
    assert one_left["a_writes"] == 4 and not one_left["hazard_free"]
    assert one_left["first_a_writes"][0].startswith("/*0010*/ LOP3.LUT R88")
    assert "HGMMA" in one_left["first_a_writes"][0].split("in flight:")[1]
    assert all_retired["a_writes"] == 0 and all_retired["hazard_free"]
    assert all_retired["waits"] == ["gsb0, 0x0"] and all_retired["hgmma_loops"] == 1
    assert acc_read["accumulator_accesses"] == 1 and not acc_read["hazard_free"]  # FADD reads R24, R25
    assert predicated_wait["unknown_waits"] and not predicated_wait["hazard_free"]
    assert walk(tmp_path, [loop("0x1")], rounds=1)[0]["a_writes"] == 0  # the hazard is across iterations


def test_releases_with_the_hazard_get_two_tile_forms(monkeypatch):
    """matmul_configs.wgmma_hazard reads the release; under one with the hazard every one-tile tl.dot
    candidate is offered as two tiles on two stages (GEMV, dense and decode forms unchanged)."""
    from runtime.kernels import matmul_configs
    from runtime.kernels.weight_layout import KernelWeight

    assert [matmul_configs.wgmma_hazard(v) for v in ("3.6.0", "3.8.0", "3.9.0", "3.10.1")] == [True, True, False, False]
    kw = KernelWeight(None, None, None, None, 8192, 8192, 4, 128)
    newest = {M: matmul_configs.candidate_configs(M, kw) for M in (1, 16, 64, 4096)}
    monkeypatch.setattr(matmul_configs.triton, "__version__", "3.6.0")
    for M, configs in newest.items():
        offered = matmul_configs.candidate_configs(M, kw)
        assert all(c.step_tiles == 2 for c in offered if c.use_dot)
        expected = [c if not c.use_dot or c.step_tiles > 1 else
                    matmul_configs.MatmulConfig(c.block_m, c.block_n, c.split_k, group_m=c.group_m,
                                                num_warps=c.num_warps, num_stages=2, step_tiles=2) for c in configs]
        assert offered == list(dict.fromkeys(expected)), M
    assert len(matmul_configs.candidate_configs(4096, kw)) < len(newest[4096])  # the stage counts merge


def test_the_walk_sees_triton36s_hazard_in_the_real_kernel(triton_release):
    """128x64, 4 warps, 3 stages, TMA, W4 fp16 (the H200's failing launch): hazardous under 3.6."""
    script = ("import json; from bench.wgmma_hazard import DotLaunch, check; "
              "from runtime.kernels.matmul_configs import MatmulConfig; "
              "print(json.dumps(check(DotLaunch('65+ rows', MatmulConfig(128, 64), 4, 'fp16', True))))")
    run = triton_release.run(["-c", script], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["register_a_hgmma"] == 16 and report["hgmma_loops"] == 1
    if triton_release.version.startswith("3.6."):
        assert report["a_writes"] > 0 and "gsb0, 0x7" in report["waits"]
    else:
        assert report["hazard_free"], report


def test_every_launch_the_tuner_may_choose_on_sm90_under_triton36_is_hazard_free(triton_release, tmp_path):
    if not triton_release.version.startswith("3.6."):
        pytest.skip("asserted under Triton 3.6 (the lent GPU's release); the other releases: "
                    "bench/results/kernels/wgmma-hazard-*.json")
    out = tmp_path / "hazard.json"
    run = triton_release.run(["-m", "bench.wgmma_hazard", "--jobs", "2", "--json", out], timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = json.loads(out.read_text())["reports"]
    assert {r["regime"] for r in reports} == {"decode (2..16 rows)", "17..64 rows", "65+ rows"}
    hazardous = [f"{r['name']}: {r['a_writes']} A writes" for r in reports if not r["hazard_free"]]
    assert not hazardous, hazardous
