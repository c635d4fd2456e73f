"""The ahead-of-time compile tier: TPU / CUDA compilers run here against described devices.

Needs the ``aot`` extra (libtpu, the CUDA PJRT plugin): ``bash scripts/test_aot.sh`` makes
its own venv with it. Where a compiler is missing, its tests skip with a one-line reason,
so the main suite (which collects this folder too) stays green without the extra.
"""

import os

# No CUDA driver here: the CUDA plugin must not insist on one (read when jax initialises
# its backends, which happens after this file is imported).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# libtpu takes a lock file (/tmp/libtpu_lockfile) so that one process owns the TPU; there
# is none here, and the xdist workers each load libtpu to compile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

from v41jax.kernels import aot  # noqa: E402

TPU_TOPOLOGY = "v5e:2x4"  # 8 v5e chips (16 GiB HBM, 128 MiB VMEM per chip)
CUDA_GPU, CUDA_SHAPE = "h100", "1x1x8"  # one host of 8 H100s


@pytest.fixture(scope="session")
def tpu_v5e():
    """Compile-only devices of a v5e:2x4 slice (skips when libtpu is missing)."""
    missing = aot.missing_tpu_compiler()
    if missing:
        pytest.skip(f"no TPU compiler: {missing}")
    return aot.tpu_topology(TPU_TOPOLOGY)


@pytest.fixture(scope="session")
def cuda_h100():
    """Compile-only devices of one host of 8 H100s (skips when the CUDA plugin is missing)."""
    missing = aot.missing_cuda_compiler()
    if missing:
        pytest.skip(f"no CUDA compiler: {missing}")
    return aot.cuda_topology(CUDA_GPU, CUDA_SHAPE)
