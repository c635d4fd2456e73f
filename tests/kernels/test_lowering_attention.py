"""`attend(impl="auto")` lowered from this CPU for TPU, CUDA and CPU picks the platform's
kernel, with no T x T array anywhere in the program (forward and gradient), plus the
routing of shapes a kernel cannot take and the clear errors raised before lowering.

Shapes are ShapeDtypeStructs (T = 8192, head dim 128; and an odd shape), so nothing runs.
This CPU-only jaxlib has no cuDNN, and `jax.nn.dot_product_attention(implementation=
"cudnn")` refuses to trace without one; the `cudnn_present` fixture stands in the version
probe (both jax.nn's and ours read it) so that the CUDA lowering can be checked here.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from v41jax.kernels.attention import AttentionLayout, attend, cudnn_version
from v41jax.kernels.attention import dot_product as dot_product_lib

SDS = jax.ShapeDtypeStruct
TPU_CALL, CUDNN_FWD, CUDNN_BWD = "tpu_custom_call", "__cudnn$fmhaSoftmax(", "fmhaSoftmaxBackward"


@pytest.fixture
def cudnn_present(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    assert cudnn_version() == 90800


def _args(b, t, s, h, g, kd, dtype=jnp.bfloat16, segments=False):
    layout = AttentionLayout(
        SDS((b, t), jnp.int32),
        SDS((b, s), jnp.int32),
        SDS((b, t), jnp.int32) if segments else None,
        SDS((b, s), jnp.int32) if segments else None,
    )
    return SDS((b, t, h, kd), dtype), SDS((b, s, g, kd), dtype), SDS((b, s, g, kd), dtype), layout


def _forward(q, k, v, layout):
    return attend(q, k, v, layout, impl="auto")


def _grad(q, k, v, layout):
    loss = lambda q, k, v: _forward(q, k, v, layout).astype(jnp.float32).sum()  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def lowered(fn, args, platform: str) -> str:
    # A fresh function each time: jit's trace cache must not hand back a trace made under
    # another cuDNN probe (the routing is decided in Python at trace time).
    fresh = lambda *a: fn(*a)  # noqa: E731
    return jax.jit(fresh).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def has_t_by_s(text: str, t: int, s: int) -> bool:
    return re.search(rf"tensor<[^>]*\b{t}x{s}\b", text) is not None


BIG = (1, 8192, 8192, 4, 2, 128)  # B, T, S, H, G, K


@pytest.mark.parametrize("fn", [_forward, _grad], ids=["forward", "grad"])
def test_auto_lowers_splash_for_tpu(fn):
    text = lowered(fn, _args(*BIG, segments=True), "tpu")
    calls = text.count(TPU_CALL)
    assert calls == (1 if fn is _forward else 3)  # fwd; fwd + dq + dkv kernels
    assert "splash_mqa_fwd" in text and CUDNN_FWD not in text
    assert not has_t_by_s(text, 8192, 8192)


@pytest.mark.parametrize("fn", [_forward, _grad], ids=["forward", "grad"])
def test_auto_lowers_cudnn_for_cuda(cudnn_present, fn):
    text = lowered(fn, _args(*BIG), "cuda")
    assert CUDNN_FWD in text and TPU_CALL not in text
    assert (CUDNN_BWD in text) == (fn is _grad)
    assert not has_t_by_s(text, 8192, 8192)


def test_auto_on_cuda_without_cudnn_is_blockwise():
    text = lowered(_grad, _args(*BIG), "cuda")
    if cudnn_version() is None:  # this CPU-only jaxlib
        assert "cudnn" not in text and "stablehlo.while" in text
    else:  # a CUDA jaxlib: the real probe
        assert CUDNN_FWD in text
    assert not has_t_by_s(text, 8192, 8192)


@pytest.mark.parametrize("fn", [_forward, _grad], ids=["forward", "grad"])
def test_auto_lowers_blockwise_for_cpu(fn):
    text = lowered(fn, _args(*BIG, segments=True), "cpu")
    assert "stablehlo.while" in text and TPU_CALL not in text and "cudnn" not in text
    assert not has_t_by_s(text, 8192, 8192)


def test_one_traced_program_picks_each_platforms_kernel(cudnn_present):
    traced = jax.jit(lambda *a: _grad(*a)).trace(*_args(*BIG))
    text = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("tpu", "cuda", "cpu")}
    assert TPU_CALL in text["tpu"] and CUDNN_FWD not in text["tpu"]
    assert CUDNN_FWD in text["cuda"] and TPU_CALL not in text["cuda"]
    assert TPU_CALL not in text["cpu"] and "cudnn" not in text["cpu"]


ODD = (2, 1000, 1000, 6, 2, 64)  # T not a block multiple, R = 3 query heads per kv head


def test_odd_shape_lowerings(cudnn_present):
    # TPU: T = 1000 padded to 1024 inside; packed segments go to the kernel.
    tpu = lowered(_grad, _args(*ODD, segments=True), "tpu")
    assert tpu.count(TPU_CALL) == 3 and not has_t_by_s(tpu, 1000, 1000)
    # CUDA: no segments -> cuDNN; segments, f32, or a head dim over 128 -> blockwise.
    assert CUDNN_FWD in lowered(_grad, _args(*ODD), "cuda")
    b, t, s, h, g, _ = ODD
    for args in (
        _args(*ODD, segments=True),
        _args(*ODD, dtype=jnp.float32),
        _args(b, t, s, h, g, 192),
    ):
        text = lowered(_grad, args, "cuda")
        assert "cudnn" not in text and not has_t_by_s(text, 1000, 1000)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kv_cache_layouts_lower_blockwise(cudnn_present, platform):
    """Decode with T = 4 over 8192 slots: no kernel takes it (module docstrings)."""
    text = lowered(_forward, _args(1, 4, 8192, 4, 2, 128), platform)
    assert TPU_CALL not in text and "cudnn" not in text and "stablehlo.while" in text


def test_decode_t1_lowers_cudnn_with_key_lengths(cudnn_present):
    text = lowered(_forward, _args(1, 1, 8192, 4, 2, 128), "cuda")
    assert CUDNN_FWD in text and "PADDING" in text


def test_blockwise_temp_memory_is_linear_in_t():
    """Compiled temp bytes of the gradient of two scanned "layers" of attention from T = 1024
    to 4096: about 4x for blockwise, about 16x for the reference (its [B, H, T, S] scores).
    The layout is a constant of the scan, as in the model's `nn.scan` over layers: scan
    partial evaluation must not hoist per-block masks out of the loop (blockwise.py)."""

    def temp(impl, t):
        x, _, _, layout = _args(1, t, t, 4, 4, 64, jnp.float32)
        ws = SDS((2, 64), jnp.float32)

        def grad(x, ws, layout):
            def layer(h, w):
                return attend(h * w, h, h, layout, impl=impl), None

            loss = lambda x, ws: jax.lax.scan(layer, x, ws)[0].sum()  # noqa: E731
            return jax.grad(loss, argnums=(0, 1))(x, ws)

        compiled = jax.jit(grad).trace(x, ws, layout).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blockwise = temp("blockwise", 4096) / temp("blockwise", 1024)
    reference = temp("reference", 4096) / temp("reference", 1024)
    assert blockwise < 5 and reference > 12, (blockwise, reference)


def _concrete(b=1, t=8, s=8, h=4, g=2, kd=16, **kw):
    q, k, v, layout = _args(b, t, s, h, g, kd, **kw)
    zeros = lambda x: None if x is None else jnp.zeros(x.shape, x.dtype)  # noqa: E731
    return zeros(q), zeros(k), zeros(v), AttentionLayout(*map(zeros, layout))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(impl="flash"), "impl must be one of"),
        (dict(impl="splash", block_size=100), "multiples of 128"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(h=6, g=4), "multiple of num_kv_heads"),
        (dict(dtype=jnp.int32), "floating dtype"),
        (dict(bad_layout="short"), r"q_positions_BxT must be \[1, 8\]"),
        (dict(bad_layout="one_segment"), "both q and kv segment ids"),
    ],
)
def test_clear_errors_before_lowering(change, match):
    impl, block = change.pop("impl", "auto"), change.pop("block_size", 512)
    bad = change.pop("bad_layout", None)
    q, k, v, layout = _concrete(**change)
    if bad == "short":
        layout = layout._replace(q_positions_BxT=layout.q_positions_BxT[:, :5])
    elif bad == "one_segment":
        layout = layout._replace(q_segment_ids_BxT=jnp.zeros((1, 8), jnp.int32))
    fn = lambda q, k, v: attend(q, k, v, layout, impl=impl, block_size=block)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        jax.jit(fn).trace(q, k, v)


def test_cudnn_limits_name_the_limit(cudnn_present):
    q, k, _, _ = _concrete(kd=16, dtype=jnp.float32)
    assert "float16/bfloat16" in dot_product_lib.cudnn_limits(q, k)
    q, k, _, _ = _concrete(kd=12)
    assert "multiple of 8" in dot_product_lib.cudnn_limits(q, k)
    q, k, _, _ = _concrete(kd=128)
    assert dot_product_lib.cudnn_limits(q, k) is None


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
@pytest.mark.parametrize("fn", [_forward, _grad], ids=["forward", "grad"])
def test_splash_lowers_for_tpu_under_a_multi_device_mesh(fn):
    """Mosaic kernels cannot be partitioned by GSPMD: under a mesh the kernel runs per device
    in a shard_map (batch over data x fsdp, heads over tensor), so an 8-device train step
    lowers for TPU."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from v41jax.config import MeshConfig
    from v41jax.sharding import make_mesh

    mesh = make_mesh(MeshConfig(2, 2, 2))
    q, k, v, layout = _args(4, 1024, 1024, 4, 2, 128, segments=True)
    act, seg = (
        NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")),
        NamedSharding(mesh, P(("data", "fsdp"))),
    )
    q, k, v = (SDS(x.shape, x.dtype, sharding=act) for x in (q, k, v))
    layout = AttentionLayout(*(SDS(x.shape, x.dtype, sharding=seg) for x in layout))
    with jax.set_mesh(mesh):
        text = lowered(fn, (q, k, v, layout), "tpu")
    assert "splash_mqa_fwd" in text and "sdy.manual_computation" in text


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)])  # tensor divides the heads, or does not
def test_splash_under_a_mesh_equals_the_reference(heads):
    import numpy as np

    from v41jax.config import MeshConfig
    from v41jax.sharding import make_mesh

    h, g = heads
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, 136, h, 16))
    k, v = (jax.random.normal(kk, (4, 136, g, 16)) for kk in keys[1:])
    pos = jnp.broadcast_to(jnp.arange(136, dtype=jnp.int32), (4, 136))
    seg = jnp.where(jnp.arange(136) < 70, 1, 2) * jnp.ones((4, 1), jnp.int32)
    layout = AttentionLayout(pos, pos, seg, seg)
    want = attend(q, k, v, layout, impl="reference")
    with jax.set_mesh(make_mesh(MeshConfig(2, 2, 2))):
        got = jax.jit(lambda *a: attend(*a, impl="splash", block_size=128))(q, k, v, layout)
    np.testing.assert_allclose(got, want, atol=2e-5)
