"""Speed and accuracy benchmarks and tooling (kernels, rollout throughput, Table 3 step time, the 2-GPU
check, SQNR, model sizes, notebooks): `python -m benchmarks.<name>`, run from the repository root."""
