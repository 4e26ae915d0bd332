"""16 fake CPU devices for the sharding tests (set before anything imports jax; other tests use device 0)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
