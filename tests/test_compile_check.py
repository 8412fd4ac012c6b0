"""kernels.compile_check's float64 guard, on PTX text (the compile itself needs
PROTO_BACKEND=ptx: `make compile-check`)."""
from kernels.compile_check import float64_instructions

PTX = """
.reg .f64 	%fd<3>;
	ld.global.f32 	%f1, [%rd4];
	cvt.rn.f64.u64 	%fd1, %rd150;
	setp.leu.f64 	%p3, %fd1, %fd2;
	fma.rn.f32 	%f3, %f1, %f2, %f3;
	mul.f64 	%fd2, %fd1, 0d3FE0000000000000;
	// add.f64 in a comment is not an instruction
"""


def test_float64_instructions_are_found_and_declarations_and_float32_are_not():
    assert float64_instructions(PTX) == ["cvt.rn.f64.u64", "setp.leu.f64", "mul.f64"]
    assert float64_instructions("\tadd.f32 %f1, %f2, %f3;\n.reg .f64 %fd<1>;\n") == []
