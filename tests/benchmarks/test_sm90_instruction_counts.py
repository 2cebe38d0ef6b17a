"""`benchmarks/sm90_instruction_counts.py`: the main loop read off a SASS listing."""

from __future__ import annotations

from benchmarks.sm90_instruction_counts import loop_profile

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2 ;
        /*0020*/              @!P0 BRA 0x90 ;
        /*0030*/                   LOP3.LUT R4, R4, 0x1c, RZ, 0xc0, !PT ;
        /*0040*/                   HMUL2.BF16_V2 R5, R4, R6 ;
        /*0050*/                   ISETP.GE.AND P1, PT, R7, 0x3, PT ;
        /*0060*/              @!P1 BRA 0x40 ;
        /*0070*/                   IMAD.SHL.U32 R8, R4, 0x4, RZ ;
        /*0080*/              @!P1 BRA 0x30 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0;
"""


def test_the_longest_backward_branch_bounds_the_loop_and_spills_are_counted() -> None:
    body, spills = loop_profile(_SASS)
    # 0x30 .. 0x80: the outer loop (the inner one, 0x40 .. 0x60, and the forward branch and
    # the trailing self-branch are not it)
    assert body == ["LOP3.LUT", "HMUL2.BF16_V2", "ISETP.GE.AND", "BRA", "IMAD.SHL.U32", "BRA"]
    assert spills == 1


def test_a_listing_without_a_loop_has_an_empty_body() -> None:
    assert loop_profile("        /*0000*/                   EXIT ;\n") == ([], 0)
