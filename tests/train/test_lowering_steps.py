"""The whole train step and the KV-cache decode step lower for TPU and CUDA from this CPU.

`jax.jit(f).trace(...).lower(lowering_platforms=(p,))` runs the Mosaic TPU / Triton / Mosaic
GPU lowering of every Pallas kernel inside the step without the hardware, so a kernel that
cannot compile for a platform fails here rather than on a rented machine. The model has every
feature that brings a kernel: Engram (lookup kernel), mHC single pass (its kernel), MoE, with
the kernels' "auto" impls, on a 1-device mesh and abstract (ShapeDtypeStruct) inputs: nothing
is allocated or run.

The "auto" impls choose by the platform the program is LOWERED for (`lax.platform_dependent`),
not by the default backend (CPU here): so nothing is patched, and a dispatch that looked at
the host's backend instead would show up here as a missing kernel. Kernels are found in the
lowered text by their custom call (`tpu_custom_call` on TPU, Triton's `__gpu$xla.gpu.triton`
or Mosaic GPU's `mosaic_gpu*` on CUDA) and attributed to their package under v41jax/kernels/
by the call's source location (debug info), so renaming a kernel function inside a package
does not break the check.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from v41jax import config as config_lib
from v41jax import sharding
from v41jax.decode import DecodeState, decode_step, init_cache, prefill
from v41jax.sharding import make_mesh
from v41jax.train.batches import batch_keys
from v41jax.train.state import make_state_fns
from v41jax.train.step import make_train_step

# Custom-call targets that are compiled kernels, per lowering platform.
KERNEL_TARGETS = {
    "tpu": ("tpu_custom_call",),
    "cuda": ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2", "__cudnn$"),
}
# Packages under v41jax/kernels/ whose kernel each lowered program must call. Attention: on
# TPU the train step runs splash attention; on CUDA training batches carry segment ids, which
# cuDNN (via jax.nn.dot_product_attention) cannot say, so attention is the blockwise XLA path
# (and cuDNN needs a jaxlib built with it, which this CPU jaxlib is not: the GPU device check
# covers it). KV-cache prefill and decode layouts take the blockwise path on every platform.
TRAIN_KERNELS = {
    "tpu": ("engram_lookup", "mhc_single_pass", "attention"),
    "cuda": ("engram_lookup", "mhc_single_pass"),
}
DECODE_KERNELS = ("engram_lookup", "mhc_single_pass")


def _cases(kernels_of_platform: dict[str, tuple[str, ...]]):
    return [pytest.param(p, k, id=f"{p}-{k}") for p, ks in kernels_of_platform.items() for k in ks]


# Four layers so that, with scanned layers, layers 2..3 (MoE, no Engram) form one scanned run
# while layer 0 (first single-pass state) and layer 1 (Engram) are blocks of their own.
# Widths are powers of two: the Triton kernels take only those (C = 64, Engram E = 32).
MODEL = [
    "model.num_layers=4",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=128",
    "model.max_seq_len=64",
    "data.seq_len=32",
    "data.global_batch_size=2",
    "model.engram.layer_ids=1",
    "model.engram.engram_vocab_size=101,103",
    "model.engram.n_embed_per_ngram=64",
    "model.engram.n_head_per_ngram=2",
    "model.engram.compressed_vocab_size=400",  # the data pipeline fills it in real runs
    "model.mhc.n_streams=4",
    "model.mhc.form=single_pass",
    "model.mhc.single_pass_impl=auto",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.layer_ids=2,3",
    "mesh.data=1",
]

PLATFORMS = ("tpu", "cuda")


def _config(*extra: str) -> config_lib.Config:
    return config_lib.override(config_lib.get_config("tiny"), [*MODEL, *extra])


def _plain(tree):
    """ShapeDtypeStructs without shardings (the decode functions are plain jits)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def kernel_calls(lowered_text: str, platform: str) -> dict[str, int]:
    """{kernel package under v41jax/kernels/ (or "?" when no source location names one):
    number of kernel custom calls} in `lowered_text` (`Lowered.as_text(debug_info=True)`).

    A call's package is the first v41jax/kernels/<package>/ file on its location's call
    chain. A kernel that is a jitted function of its own library (splash attention) sits in
    a private function whose locations end inside that library: it is then attributed
    through the `call` ops of that function, up the chain of callers."""
    locs = dict(re.findall(r"^(#loc\d+) = (.*)$", lowered_text, re.M))

    def package(line: str) -> str | None:
        todo, seen = re.findall(r"#loc\d+", line[line.rfind("loc(") :]), set()
        files = re.findall(r'"([^"]+\.py)"', line[line.rfind("loc(") :])
        while todo:  # breadth-first over the callsite chain: innermost frames first
            ref = todo.pop(0)
            if ref not in seen:
                seen.add(ref)
                files += re.findall(r'"([^"]+\.py)"', locs.get(ref, ""))
                todo += re.findall(r"#loc\d+", locs.get(ref, ""))
        for f in files:
            if m := re.search(r"v41jax/kernels/(\w+)/", f):
                return m.group(1)
        return None

    func, kernels, callers = None, [], {}
    for line in lowered_text.splitlines():
        if m := re.match(r"\s*func\.func (?:public |private )?@([\w$.-]+)\(", line):
            func = m.group(1)
        elif m := re.search(r"stablehlo\.custom_call @([\w$.]+)", line):
            if any(m.group(1).startswith(t) for t in KERNEL_TARGETS[platform]):
                kernels.append((func, line))
        elif m := re.search(r"\bcall @([\w$.-]+)\(", line):
            callers.setdefault(m.group(1), []).append((func, line))

    def attributed(func: str | None, line: str, depth: int = 0) -> str | None:
        found = package(line)
        for caller, call_line in callers.get(func, []) if found is None and depth < 16 else []:
            if found := attributed(caller, call_line, depth + 1):
                break
        return found

    counts: dict[str, int] = {}
    for func, line in kernels:
        key = attributed(func, line) or "?"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _train_setup(cfg: config_lib.Config):
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    model, optimizer, _, shardings, abstract_state = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    b, t = cfg.data.global_batch_size, cfg.data.seq_len
    heads = cfg.model.engram.num_heads_total
    batch = {}
    for key in batch_keys(cfg.model):
        if key == "loss_mask":
            batch[key] = jax.ShapeDtypeStruct((b, t), jnp.float32)
        elif key.startswith("engram_ids_"):
            batch[key] = jax.ShapeDtypeStruct((b, t, heads), jnp.int32)
        else:
            batch[key] = jax.ShapeDtypeStruct((b, t), jnp.int32)
    return mesh, step, abstract_state, batch


def _lower_train_step(cfg: config_lib.Config, platform: str):
    mesh, step, abstract_state, batch = _train_setup(cfg)
    # The same mesh and logical-axis rules the step runs under (`train.step._with_mesh`).
    with jax.set_mesh(mesh), sharding.axis_rules():
        traced = step.jitted.trace(abstract_state, batch)
        return traced.lower(lowering_platforms=(platform,))


_LOWERED: dict[tuple, dict[str, int]] = {}


def _train_calls(platform: str, *extra: str) -> dict[str, int]:
    """Kernel calls of the lowered train step, lowered once per (platform, config) for all
    the tests that read it (each lowering takes seconds)."""
    key = ("train", platform, *extra)
    if key not in _LOWERED:
        lowered = _lower_train_step(_config(*extra), platform)
        _LOWERED[key] = kernel_calls(lowered.as_text(debug_info=True), platform)
    return _LOWERED[key]


def _decode_inputs(cfg: config_lib.Config, batch_size: int = 2, prompt_len: int = 8):
    m = cfg.model
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    _, _, _, _, abstract_state = make_state_fns(cfg, mesh)
    params = _plain(abstract_state.params)
    window = jnp.zeros((batch_size, m.engram.max_ngram_size), jnp.int32)
    state = jax.eval_shape(lambda: DecodeState(init_cache(m, batch_size), window))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return params, state, i32(batch_size), i32(batch_size, prompt_len), i32(m.vocab_size)


def _decode_calls(platform: str, which: str) -> dict[str, int]:
    """Kernel calls of the lowered one-token decode step or prompt prefill (cached)."""
    key = (which, platform)
    if key not in _LOWERED:
        cfg = _config()
        params, state, tokens_b, prompt_bxp, compression = _decode_inputs(cfg)
        positions_b = lengths_b = tokens_b  # int32 [B] each
        if which == "decode":
            traced = decode_step.trace(params, cfg.model, tokens_b, state, positions_b, compression)
        else:
            traced = prefill.trace(params, cfg.model, prompt_bxp, lengths_b, compression)
        lowered = traced.lower(lowering_platforms=(platform,))
        _LOWERED[key] = kernel_calls(lowered.as_text(debug_info=True), platform)
    return _LOWERED[key]


def _expect(calls: dict[str, int], kernel: str, where: str) -> None:
    assert calls.get(kernel), f"{where}: no kernel custom call from {kernel}; found {calls}"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_train_step_lowers(platform):
    assert _config().model.scan_layers  # the default, exercised here
    _train_calls(platform)  # Mosaic / Triton lowering errors raise here


@pytest.mark.parametrize("platform,kernel", _cases(TRAIN_KERNELS))
def test_train_step_calls_kernel(platform, kernel):
    _expect(_train_calls(platform), kernel, f"train step for {platform}")


def test_unscanned_train_step_calls_a_kernel_per_site():
    """The unrolled layer loop lowers too, with one kernel call per call site."""
    calls = _train_calls("tpu", "model.scan_layers=false")
    # Every sub-layer runs the single pass except where the streams are materialised: layer
    # 0's attention (the first state) and layer 1's (after Engram) -> 8 - 2 = 6 call sites,
    # each a forward kernel and its fused backward kernel.
    assert calls.get("mhc_single_pass") == 2 * 6 and calls.get("engram_lookup") == 1, calls


# Each (platform, program) is a lowering of its own: decode for TPU and prefill for CUDA
# stay fast, the other two are slow.
DECODE_FAST = {("tpu", "decode"), ("cuda", "prefill")}


def _decode_marks(platform: str, which: str):
    return () if (platform, which) in DECODE_FAST else pytest.mark.slow


@pytest.mark.parametrize(
    "platform,which",
    [
        pytest.param(p, w, id=f"{p}-{w}", marks=_decode_marks(p, w))
        for w in ("decode", "prefill")
        for p in PLATFORMS
    ],
)
def test_decode_and_prefill_lower(platform, which):
    _decode_calls(platform, which)


@pytest.mark.parametrize(
    "platform,kernel,which",
    [
        pytest.param(p, k, w, id=f"{p}-{k}-{w}", marks=_decode_marks(p, w))
        for w in ("decode", "prefill")
        for p in PLATFORMS
        for k in DECODE_KERNELS
    ],
)
def test_decode_and_prefill_call_kernel(platform, kernel, which):
    _expect(_decode_calls(platform, which), kernel, f"{which} for {platform}")


def test_kernel_calls_attributes_by_source_location():
    """The text parser itself, on a hand-written module: a kernel call whose location chain
    passes through v41jax/kernels/engram_lookup/; one inside a library's private function,
    attributed through its caller's location; one with no location; a non-kernel call."""
    text = "\n".join(
        [
            "func.func public @main(%a: tensor<1xf32>) {",
            '  %0 = stablehlo.custom_call @tpu_custom_call(%a) {kernel_name = "k"} loc(#loc3)',
            "  %1 = stablehlo.custom_call @tpu_custom_call(%a)",
            "  %2 = stablehlo.custom_call @Sharding(%a) loc(#loc3)",
            "  %3 = call @_lib_kernel(%a) : (tensor<1xf32>) -> tensor<1xf32> loc(#loc5)",
            "}",
            "func.func private @_lib_kernel(%a: tensor<1xf32>) {",
            "  %0 = stablehlo.custom_call @tpu_custom_call(%a) loc(#loc6)",
            "}",
            '#loc1 = loc("/x/v41jax/kernels/engram_lookup/kernel.py":10:4)',
            '#loc2 = loc("/x/v41jax/engram/layer.py":3:1)',
            "#loc3 = loc(callsite(#loc1 at #loc2))",
            '#loc4 = loc("/x/v41jax/kernels/attention/splash.py":7:2)',
            '#loc5 = loc("_splash"(#loc4))',
            '#loc6 = loc("/site-packages/jax/experimental/pallas/ops/tpu/splash.py":1:1)',
        ]
    )
    assert kernel_calls(text, "tpu") == {"engram_lookup": 1, "attention": 1, "?": 1}
    assert kernel_calls(text, "cuda") == {}
