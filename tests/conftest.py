"""16 fake CPU devices for the sharding tests (set before anything imports jax; other tests use device 0).

Each module's compiled programs are dropped when the module ends. An XLA:CPU executable keeps its
machine code in memory maps of its own: three engine modules in one process left 34,000 maps, and an
xdist worker running half the suite passes the kernel's vm.max_map_count (65,530), where an mmap
fails inside XLA's compiler and the worker aborts or segfaults in whichever compile comes next (CI
timed out on that). Dropping them keeps a worker near 2,000."""

import gc
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
