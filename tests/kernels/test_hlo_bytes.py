"""v41jax.kernels.hlo_bytes: per-instruction bytes of a compiled module, checked on a CPU
compile against cost_analysis() and on a hand-written TPU-style module for the special
cases (a Pallas kernel's cost estimate, async copies and slices, free instructions)."""

import jax
import jax.numpy as jnp
import pytest

from v41jax.kernels import hlo_bytes

TPU_STYLE = """HloModule m
%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}
ENTRY %main (a: f32[64,128], b: f32[16]) -> f32[64,128] {
  %a = f32[64,128]{1,0:T(8,128)} parameter(0)
  %b = f32[16]{0} parameter(1)
  %copy-start = (f32[64,128]{1,0:T(8,128)}, f32[64,128]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%a)
  %copy-done = f32[64,128]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %slice-start = ((f32[64,128]{1,0}), f32[8,128]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:8], [0:128]}
  %slice-done = f32[8,128]{1,0:T(8,128)S(1)} slice-done(%slice-start)
  %k = (f32[64,128]{1,0}, f32[16]{0}) custom-call(%copy-done, %copy-done, %b), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/blk/attn_mix/attn_mix._single_pass/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"12345","remote_bytes_transferred":"0"}}}
  %gte = f32[64,128]{1,0} get-tuple-element(%k), index=0
  %f = f32[64,128]{1,0} fusion(%gte, %slice-done), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/blk/attn_mix/attn_mix._single_pass/attn/dot_general"}
  %m = f32[64,128]{1,0} multiply(%f, %f), metadata={op_name="jit(step)/blk/attn_mix/mul"}
  ROOT %r = f32[64,128]{1,0} add(%m, %a), metadata={op_name="jit(step)/head/add"}
}
"""  # noqa: E501


def test_special_cases_and_parts_of_a_tpu_style_module():
    ops = {op.name: op for op in hlo_bytes.instruction_bytes(TPU_STYLE)}
    assert set(ops) == {"copy-start", "slice-start", "k", "f", "m", "r"}  # the rest are free
    full, tile = 64 * 128 * 4, 8 * 128 * 4
    assert ops["copy-start"].bytes == 2 * full  # source read and written
    assert ops["slice-start"].bytes == 2 * tile  # the slice, not the source
    assert ops["k"].bytes == 12345  # the kernel's own estimate, not 2 x its repeated operand
    assert ops["f"].bytes == 2 * full + tile
    assert ops["m"].bytes == ops["r"].bytes == 3 * full
    assert hlo_bytes.bytes_by_part(TPU_STYLE) == {
        "mhc_kernels": 12345, "mhc_xla": 3 * full, "sublayers": 2 * full + tile,
        "model_other": 3 * full, "compiler_inserted": 2 * full + 2 * tile,
    }  # fmt: skip


def test_a_cpu_compile_sums_to_cost_analysis():
    def f(x, w):
        with jax.named_scope("blk_mix"):
            h = jnp.tanh(x @ w)
        return (h * 2).sum(axis=0)

    compiled = jax.jit(f).lower(jnp.ones((256, 512)), jnp.ones((512, 384))).compile()
    ops = hlo_bytes.instruction_bytes(compiled.as_text())
    assert ops and all(op.bytes > 0 for op in ops)
    expected = compiled.cost_analysis()["bytes accessed"]
    assert sum(op.bytes for op in ops) == pytest.approx(expected, rel=0.1)
    assert sum(hlo_bytes.bytes_by_part(compiled.as_text()).values()) == sum(o.bytes for o in ops)


def test_shapes_and_errors():
    assert hlo_bytes.shape_bytes("(f32[8,128]{1,0}, bf16[3], s32[], pred[2,2])") == 4096 + 6 + 4 + 4
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_bytes.instruction_bytes("HloModule m\n")
