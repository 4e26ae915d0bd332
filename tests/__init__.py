"""The pytest suite, on CPU (`make test`): one folder per package, small configs, Pallas kernels in
interpret mode, 16 fake devices for meshes. Tests that compare two numeric paths go through the
referee in tests/agreement.py; tests/test_architecture.py enforces the import arrows."""
