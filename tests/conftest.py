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
