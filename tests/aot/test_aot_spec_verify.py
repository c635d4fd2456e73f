"""Speculative verification's TPU kernel compiled (not only lowered) for v5e, V = 129,280.

The kernel asks Mosaic for a VMEM limit from its model (``limits.blocked_vmem_bytes`` plus a
quarter). Counting the pipeline's blocks alone, the model was short of what Mosaic reserves
(its own scratch for the [K+1, bv] f32 values): one-hot drafts at K = 7, bv = 98,304 needed
23.92 MiB against a 23 MiB limit, K = 15 at bv = 32,768 19.82 MiB against 16. The model now
counts that scratch, calibrated on these compiles. Asserted per compile (B = 64 rows sharded
over the 8 chips of v5e:2x4; nothing allocated): the Mosaic call is in the program, the
scoped VMEM Mosaic reserved is within the model, and the limit asked for is within the cap;
a block whose limit would pass the cap is refused, naming block_v and the bytes, before the
compiler sees it. The Triton row loop compiles for H100 at the same scale. The op has no
gradient (integer outputs).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from v41jax.kernels import aot
from v41jax.kernels.platforms import TPU_MAX_VMEM, tpu_vmem_limit
from v41jax.kernels.spec_verify import spec_verify
from v41jax.kernels.spec_verify.limits import blocked_vmem_bytes

S = jax.ShapeDtypeStruct
B, V = 64, 129_280
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
# (K, block_v, p dtype, draft laws?): the whole row (the case) with one-hot drafts
# (the most scratch at K + 1 <= 8) and with laws in bf16; the two blocks the old model sent
# to the compiler short.
CASES = [
    (7, V, "f32", False),
    (7, V, "bf16", True),
    (7, 98_304, "f32", False),
    (15, 32_768, "f32", True),
]


def _args(k, dtype, with_q):
    i32, f32 = jnp.int32, jnp.float32
    q = S((B, k, V), dtype) if with_q else None
    return [
        S((B, k), i32),
        q,
        S((B, k + 1, V), dtype),
        S((B,), i32),
        S((B, k), f32),
        S((B, V), f32),
    ]


def _verify(mesh, block_v, with_q):
    specs = (P("data"), P("data") if with_q else None) + (P("data"),) * 4
    fn = lambda *a: spec_verify(*a, impl="pallas", block_v=block_v)  # noqa: E731
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("data"), check_vma=False), [
        s or P() for s in specs
    ]


@pytest.mark.parametrize(
    "k,block_v,dtype,with_q",
    CASES,
    ids=[f"K{c[0]}-bv{c[1]}-{c[2]}-{'laws' if c[3] else 'onehot'}" for c in CASES],
)
def test_blocked_kernel_compiles_within_its_vmem_model(tpu_v5e, k, block_v, dtype, with_q):
    mesh = aot.topology_mesh(tpu_v5e)
    fn, specs = _verify(mesh, block_v, with_q)
    args = _args(k, DTYPES[dtype], with_q)
    _, record = aot.compile_for(fn, args, mesh, in_specs=specs)
    assert aot.MOSAIC_CUSTOM_CALL in record.custom_calls
    model = blocked_vmem_bytes(k, min(block_v, V), 4, with_q)  # race_u is f32: 4 bytes
    limit = tpu_vmem_limit(model)
    assert limit is not None and model < limit <= TPU_MAX_VMEM
    (used,) = record.scoped_vmem_bytes
    assert 0 < used <= model, (used, model)


@pytest.mark.parametrize("k,block_v", [(15, V), (15, 65_536)])
def test_block_over_the_vmem_cap_is_refused_before_the_compiler(tpu_v5e, k, block_v):
    """K = 15 with draft laws: Mosaic reserved 41.58 MiB at bv = 65,536 (the old model
    asked for 26); the model's limit is over the 48 MiB cap, so lowering for TPU raises."""
    mesh = aot.topology_mesh(tpu_v5e)
    fn, specs = _verify(mesh, block_v, True)
    args = aot.shaped_args(_args(k, jnp.float32, True), mesh, specs)
    traced = jax.jit(fn).trace(*args)
    pattern = rf"block_v = {block_v} at K = {k} needs \d+ bytes of VMEM .* over the 48 MiB"
    with pytest.raises(ValueError, match=pattern):
        traced.lower()


def test_gpu_kernel_compiles_for_h100_over_the_whole_row(cuda_h100):
    """The Triton row loop at K = 7, V = 129,280 (block_v 1024: a loop over the row)."""
    mesh = aot.topology_mesh(cuda_h100)
    fn, specs = _verify(mesh, 1024, True)
    _, record = aot.compile_for(fn, _args(7, jnp.bfloat16, True), mesh, in_specs=specs)
    assert "__gpu$xla.gpu.triton" in record.custom_calls


@pytest.mark.parametrize("topology", ["v5p:2x2x2", "v6e:2x4"])
def test_whole_row_compiles_for_other_generations(tpu_v5e, topology):
    """The whole V = 129,280 row at K = 7 (one-hot drafts, and bf16 laws) on 8 chips of v5p
    and v6e: compiled, Mosaic's reservation within the limit the kernel asks for."""
    mesh = aot.topology_mesh(aot.tpu_topology(topology))
    for dtype, with_q in (("f32", False), ("bf16", True)):
        fn, specs = _verify(mesh, V, with_q)
        _, record = aot.compile_for(fn, _args(7, DTYPES[dtype], with_q), mesh, in_specs=specs)
        limit = tpu_vmem_limit(blocked_vmem_bytes(7, V, 4, with_q))
        (used,) = record.scoped_vmem_bytes
        assert 0 < used <= limit <= TPU_MAX_VMEM, (topology, dtype, used, limit)
