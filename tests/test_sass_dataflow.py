"""bench/sass_dataflow.py's dequantization slice on hand-written SASS (no compiler needed): the
chop from a loop's loads to its tensor-core operands, and nothing else."""

from bench.sass_dataflow import dequant_report, dequant_slice, parse_sass

# One loop iteration: weight words (a 64-bit load), a scale, a word loaded for the next
# iteration at the bottom, address math, a constant, a dead value and one stored to global.
LOOP = """
        /*0000*/                   HADD2 R43, R50, -R8.H0_H0 ;
        /*0010*/                   LDS.64 R4, [R2+0x100] ;
        /*0020*/                   LDS.U16 R6, [R2+0x200] ;
        /*0030*/                   IMAD.MOV.U32 R8, RZ, RZ, 0x64006400 ;
        /*0040*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0050*/                   LOP3.LUT R10, R4, 0xf000f, R8, 0xea, !PT ;
        /*0060*/                   SHF.R.U32.HI R11, RZ, 0x4, R5 ;
        /*0070*/                   LOP3.LUT R11, R11, 0xf000f, R8, 0xea, !PT ;
        /*0080*/                   HFMA2 R10, R10, R6.H0_H0, -R12 ;
        /*0090*/                   HMUL2 R11, R11, R6.reuse.H0_H0 ;
        /*00a0*/                   HADD2 R60, R4, R4 ;
        /*00b0*/                   LOP3.LUT R20, R4, 0xff, RZ, 0xc0, !PT ;
        /*00c0*/                   STG.E desc[UR4][R30.64], R20 ;
        /*00d0*/                   MOV R40, R10 ;
        /*00e0*/                   IMAD.MOV.U32 R41, RZ, RZ, R11 ;
        /*00f0*/                   MOV R42, 0x0 ;
        /*0100*/                   WARPGROUP.ARRIVE ;
        /*0110*/                   HGMMA.64x16x16.F32 R24, R40, gdesc[UR8], R24 ;
        /*0120*/                   LDS R50, [R2+0x300] ;
        /*0130*/                   @P0 BRA 0x0 ;
"""
COUNTED = [0x00, 0x50, 0x60, 0x70, 0x80, 0x90, 0xD0, 0xE0]


def test_the_slice_is_the_path_from_loads_to_operands():
    body = parse_sass(LOOP)
    assert len(body) == 20
    picked = [body[i].address for i in dequant_slice(body)]
    # 0x00 is fed by the previous iteration's load (0x120); 0x60 reads R5, the 64-bit load's high
    # half; not counted: loads, address math, the constant, the dead value, the stored value,
    # the MMA and the register operand filled by a constant (0xf0)
    assert picked == COUNTED


def test_per_element_divides_by_the_weights_a_thread_dequantizes():
    report = dequant_report(parse_sass(LOOP), units_per_thread=4)
    assert report["instructions"] == len(COUNTED) and report["per_unit"] == len(COUNTED) / 4
    assert report["opcodes"]["LOP3"] == 2 and report["addresses"] == COUNTED


def test_an_operand_from_shared_memory_ends_the_slice_at_the_store():
    body = parse_sass(LOOP.replace("HGMMA.64x16x16.F32 R24, R40, gdesc[UR8], R24",
                                   "STS.128 [R3+0x40], R40"))
    assert [body[i].address for i in dequant_slice(body)] == COUNTED


def test_a_loop_without_tensor_core_instructions_has_no_slice():
    assert dequant_report(parse_sass(LOOP.replace("HGMMA.64x16x16.F32 R24, R40, gdesc[UR8], R24", "NOP")), 4) is None
