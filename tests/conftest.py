"""16 fake CPU devices for the sharding tests (set before anything imports jax; other tests use device 0).

Each module's compiled programs are dropped when the module ends. An XLA:CPU executable keeps its
machine code in memory maps of its own: three engine modules in one process left 34,000 maps, and an
xdist worker running half the suite passes the kernel's vm.max_map_count (65,530), where an mmap
fails inside XLA's compiler and the worker aborts or segfaults in whichever compile comes next (CI
timed out on that). Dropping them keeps a worker near 2,000.

What a later module (or the other xdist worker, or a server a test starts) compiles again is loaded
from one on-disk compilation cache for the run instead, made here by the process that starts first
(the xdist controller: the workers and servers inherit its environment) and removed when it exits.
Compiling is most of the suite's time (six serve modules: 182 s cold, 73 s from a full cache), and
modules share programs: the cache took those six from 182-190 s to 156 s. A program loaded from it
counts as a compilation in the tests' compile counts (tests/serve/test_engine.py's CountCompiles)."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3jax-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the many small programs are shared too
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
