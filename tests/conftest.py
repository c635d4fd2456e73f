"""Test-wide setup: 8 fake CPU devices, set before jax is first imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One tokenizer/token cache for the session (subprocesses inherit it), never ~/.cache."""
    if "V41JAX_TEST_CACHE" in os.environ:  # reuse across sessions when asked
        os.environ["V41JAX_CACHE"] = os.environ["V41JAX_TEST_CACHE"]
    else:
        os.environ["V41JAX_CACHE"] = str(tmp_path_factory.mktemp("v41jax_cache"))
    yield


def accelerator_platform() -> str | None:
    """ "gpu" or "tpu" when the tests run on an accelerator (scripts/device_check.sh), else None."""
    import jax

    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu") else None


@pytest.fixture(params=["interpret", "compiled"])
def interpret(request) -> bool:
    """Every kernel test runs twice: in the Pallas interpreter (here and in CI) and compiled
    (its twin, skipped unless an accelerator is present; `scripts/device_check.sh` runs the
    twins with `-k compiled`). The test receives `interpret` to pass to the kernel."""
    if request.param == "compiled" and accelerator_platform() is None:
        pytest.skip("compiled twin: runs on a GPU/TPU (bash scripts/device_check.sh)")
    return request.param == "interpret"
