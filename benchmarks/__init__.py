"""Benchmarks: `python -m benchmarks.NAME` prints a table and writes its JSON under benchmarks/results/;
`python -m benchmarks.run_all` (`make bench`) runs the CPU ones, `bash benchmarks/gpu_check.sh` the GPU
checks. Figures are ratios measured side by side in one run; benchmarks/README.md records them."""
