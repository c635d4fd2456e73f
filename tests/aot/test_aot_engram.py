"""The Engram lookup compiled (not only lowered) for TPU v5e and H100, at the issue's shapes.

Mosaic once refused the TPU DMA gather for bf16 / fp8 tables ("Offsets along tiled
dimensions must be aligned to tiles": a single packed row DMA'd at an arbitrary offset);
the kernel now fetches each row's aligned group (``rows_per_dma``). Nothing is allocated
(``ShapeDtypeStruct``s). Asserted per compile: the kernel's custom call is in the compiled
program; on TPU the scoped VMEM Mosaic reserved for each kernel is within the kernel's own
plan (``dma_vmem_bytes``, or the limit it asks for); no copy of a lane-dense table is made.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from v41jax.kernels import aot
from v41jax.kernels.engram_lookup import engram_lookup
from v41jax.kernels.engram_lookup.kernel import dma_vmem_bytes, rows_per_dma
from v41jax.kernels.platforms import TPU_DEFAULT_SCOPED_VMEM, tpu_vmem_limit

S = jax.ShapeDtypeStruct
GPU_CALL = "__gpu$xla.gpu.triton"
# (table, row_scale, ids, block_tokens): the flagship FP8 table (4 GiB) at 8192
# tokens x 24 heads, its odd bf16 shape (a prime row count, 3 x 1001 tokens x 7 heads), and
# f32 at the large block that needs more than the default scoped VMEM.
FP8 = (S((1 << 24, 256), jnp.float8_e4m3fn), S((1 << 24,), jnp.float32), S((8192, 24), jnp.int32))
BF16_ODD = (S((999_983, 64), jnp.bfloat16), None, S((3, 1001, 7), jnp.int32))
F32_BIG_BLOCK = (
    S((1 << 20, 256), jnp.float32),
    S((1 << 20,), jnp.float32),
    S((512, 24), jnp.int32),
)


def _lookup(block_tokens=None):
    def fn(table, ids, scale):
        return engram_lookup(table, ids, scale, block_tokens=block_tokens)

    return fn


def _check_tpu(record, table, ids, scale, block_tokens=None, calls=1):
    assert aot.MOSAIC_CUSTOM_CALL in record.custom_calls
    rows = (block_tokens or 8) * ids.shape[-1]
    plan = dma_vmem_bytes(rows, table.shape[1], table.dtype, jnp.float32, scale is not None)
    # The plan's claim: Mosaic needs at most the limit the kernel asks for, or, without one,
    # the plan plus the quarter the default scope keeps spare (Mosaic's own scratch: v4
    # reserved 0.7% over the plan for the fp8 table).
    budget = tpu_vmem_limit(plan) or plan + plan // 4
    assert budget <= max(TPU_DEFAULT_SCOPED_VMEM, tpu_vmem_limit(plan) or 0)
    assert len(record.scoped_vmem_bytes) == calls
    assert all(0 < used <= budget for used in record.scoped_vmem_bytes), (
        record.scoped_vmem_bytes,
        plan,
    )
    return plan


def test_fp8_flagship_compiles_for_v5e_sharded_over_8_chips(tpu_v5e):
    """Tokens sharded over the 8 chips (1024 x 24 = 24,576 ids per chip: one kernel call),
    the 4 GiB table and its scales replicated."""
    table, scale, ids = FP8
    mesh = aot.topology_mesh(tpu_v5e)
    fn = jax.shard_map(
        _lookup(),
        mesh=mesh,
        in_specs=(P(), P("data"), P()),
        out_specs=P("data"),
        check_vma=False,
    )
    _, record = aot.compile_for(fn, [table, ids, scale], mesh, in_specs=[P(), P("data"), P()])
    _check_tpu(record, table, S((1024, 24), jnp.int32), scale)
    table_bytes = table.shape[0] * table.shape[1]
    assert record.memory["argument_size_in_bytes"] >= table_bytes
    # The kernel reads the table where it lies: no relayout copy (temporaries are the ids'
    # gathered scales and padding, not gigabytes).
    assert record.memory["temp_size_in_bytes"] < table_bytes // 100


@pytest.mark.parametrize("case", ["bf16_odd", "f32_block_tokens_128"])
def test_forward_compiles_for_v5e(tpu_v5e, case):
    table, scale, ids = {"bf16_odd": BF16_ODD, "f32_block_tokens_128": F32_BIG_BLOCK}[case]
    block_tokens = 128 if case.startswith("f32") else None
    mesh = aot.topology_mesh(tpu_v5e.devices[:1])
    _, record = aot.compile_for(_lookup(block_tokens), [table, ids, scale], mesh)
    plan = _check_tpu(record, table, ids, scale, block_tokens)
    if case.startswith("f32"):  # 3072 rows of 256 f32 per block: over the default scope
        assert tpu_vmem_limit(plan) is not None
    else:
        assert rows_per_dma(table.dtype) == 16


@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5p:2x2x1", "v6e:2x4"])
def test_packed_tables_compile_for_other_generations(tpu_v5e, topology):
    """fp8 (1024 tokens, one chip's share) and the odd bf16 shape on one chip of each
    other generation this libtpu knows (tiling differs by generation)."""
    mesh = aot.topology_mesh(aot.tpu_topology(topology).devices[:1])
    for table, scale, ids in (FP8, BF16_ODD):
        ids = S((1024, 24), jnp.int32) if table.dtype == jnp.float8_e4m3fn else ids
        _, record = aot.compile_for(_lookup(), [table, ids, scale], mesh)
        _check_tpu(record, table, ids, scale)


def test_gradient_compiles_for_v5e(tpu_v5e):
    """bf16 odd table: the kernel forward and the d_table scatter-add backward."""
    table, _, ids = BF16_ODD

    def loss_and_grad(t, i):
        return jax.value_and_grad(lambda t: jnp.sum(engram_lookup(t, i)))(t)

    mesh = aot.topology_mesh(tpu_v5e.devices[:1])
    _, record = aot.compile_for(loss_and_grad, [table, ids], mesh)
    _check_tpu(record, table, ids, None)


def test_fp8_flagship_compiles_for_h100(cuda_h100):
    """The Triton vector gather on one H100: the FP8 table read as uint16 pairs."""
    table, scale, ids = FP8
    mesh = aot.topology_mesh(cuda_h100.devices[:1])
    _, record = aot.compile_for(_lookup(), [table, ids, scale], mesh, custom_call=GPU_CALL)
    assert record.has_custom_call
    assert record.memory["temp_size_in_bytes"] == 0  # the uint16 view is a bitcast
    assert record.memory["output_size_in_bytes"] == 8192 * 24 * 256 * 4
