"""Test-wide setup: 8 fake CPU devices, set before jax is first imported."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _xla_cache_dir() -> tuple[str, bool]:
    """(directory of the persistent XLA compilation cache, whether this process made it).

    The same programs compile in several processes of a run: the tiny config's train step in
    the train/CLI tests and in the `python -m v41jax` subprocesses they start, the xdist
    workers' common helpers. A cache that they share compiles each once. It is set through
    the environment (jax reads JAX_* variables as its config defaults), so that the xdist
    workers, which the controller starts after importing this file, and every subprocess
    inherit it. V41JAX_TEST_XLA_CACHE names a directory to keep across runs; by default the
    controller makes a fresh one for the run and removes it at the end. The cache key holds
    the program, the jax/jaxlib version and the XLA flags, so a kept cache stays valid."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # set by the caller, or inherited
        return os.environ["JAX_COMPILATION_CACHE_DIR"], False
    if os.environ.get("V41JAX_TEST_XLA_CACHE", "off") != "off":
        return os.path.expanduser(os.environ["V41JAX_TEST_XLA_CACHE"]), False
    import tempfile

    return tempfile.mkdtemp(prefix="v41jax-xla-cache-"), True


_XLA_CACHE, _XLA_CACHE_OWNED = None, False
if os.environ.get("V41JAX_TEST_XLA_CACHE") == "off":  # "off": no persistent cache at all,
    os.environ["V41JAX_COMPILATION_CACHE"] = "off"  # not even the runs' default one
else:
    _XLA_CACHE, _XLA_CACHE_OWNED = _xla_cache_dir()
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    # Only programs whose compile takes a while are worth a disk round trip.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # A kept directory is trimmed (least recently used first) past 4 GiB.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _XLA_CACHE_OWNED and not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def _memory_maps() -> int:
    """This process's memory mappings (lines of /proc/self/maps; 0 where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# Each program XLA:CPU compiles holds about six memory mappings (its JIT-ed code and data)
# for as long as jax's caches keep it. A worker that runs hundreds of test files compiles
# thousands of programs and reaches the kernel's limit on mappings per process
# (vm.max_map_count, 65,530 by default); the next mmap inside LLVM then fails and the worker
# dies with a segfault in whatever compile comes next (seen in CI: the core had 65,506 maps).
# So the compiled programs are dropped when a worker moves on to another file, and within a
# file once it holds more than MAX_MAPS mappings.
MAX_MAPS = 30_000


def pytest_runtest_teardown(item, nextitem):
    if "jax" not in sys.modules:
        return
    if nextitem is None or nextitem.path != item.path or _memory_maps() > MAX_MAPS:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


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


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """A kernel case marked slow is slow in the Pallas interpreter; its compiled twin (the
    `interpret` fixture below) stays in the fast selection: skipped at no cost on a CPU, and
    on an accelerator `scripts/device_check.sh` runs it (`-k compiled`, fast tests)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("interpret") == "compiled":
            item.own_markers = [m for m in item.own_markers if m.name != "slow"]


@pytest.fixture(params=["interpret", "compiled"])
def interpret(request) -> bool:
    """Every kernel test runs twice: in the Pallas interpreter (here and in CI) and compiled
    (its twin, skipped unless an accelerator is present; `scripts/device_check.sh` runs the
    twins with `-k compiled`). The test receives `interpret` to pass to the kernel."""
    if request.param == "compiled" and accelerator_platform() is None:
        pytest.skip("compiled twin: runs on a GPU/TPU (bash scripts/device_check.sh)")
    return request.param == "interpret"
