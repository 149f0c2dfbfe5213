"""scripts/sass_counts.py's counting, on the CPU (compiling needs the `hopper` extra; counting a
listing does not): every instruction once, predicated ones included, opcode families by prefix,
and local-memory spills (STL / LDL with any width or cache suffix) counted apart, and instructions past
address 0xffff (five hex digits: kernels of more than 4,096 instructions) counted too."""
from tests.script_modules import load_script

LISTING = """
        /*0000*/                   IMAD.WIDE.U32 R48, R18, -0x2daee0ad, RZ ;
        /*0010*/              @!P0 LOP3.LUT R2, R3, R4, RZ, 0x96, !PT ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR40], R24 ;
        /*0030*/                   STL.64 [R1+0x8], R16 ;
        /*0040*/                   STL [R1+0x4], R4 ;
        /*0050*/                   LDL.LU R6, [R1+0x14] ;
        /*0060*/               @P1 BRA `(.L_x_20) ;
        /*0070*/                   SHFL.BFLY PT, R5, R6, 0x4, 0x1f ;
        /*0080*/                   SHF.R.U32.HI R7, RZ, 0x8, R6 ;
.L_x_20:
        /*0090*/                   EXIT ;
        /*fff0*/                   FSEL R3, R4, RZ, P0 ;
        /*10000*/                  IMAD R17, R17, UR11, R2 ;
        /*1a2b0*/                  MUFU.EX2 R5, R6 ;
"""


def test_counts_instructions_families_and_spills():
    counts = load_script("sass_counts").count(LISTING)
    assert counts["total"] == 13
    assert counts["IMAD"] == 2 and counts["LOP3"] == 1 and counts["HGMMA"] == 1
    assert counts["SHFL"] == 1 and counts["SHF"] == 1   # SHF is not a prefix of SHFL's family
    assert counts["STL"] == 2 and counts["LDL"] == 1
    assert counts["FSEL"] == 1 and counts["MUFU.EX2"] == 1


def test_register_split_reads_setmaxnreg_targets_in_order():
    listing = """
        /*0520*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;
        /*0530*/                   IMAD R1, R1, 0x2, RZ ;
        /*2f00*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
"""
    script = load_script("sass_counts")
    assert script.register_split(listing) == [24, 240]
    assert script.register_split(LISTING) == []
