"""Benchmark tooling: the suite, the public-call table, the end-to-end model
benchmark and the reshape + linear baselines. No library module imports it; only the
``gemmconv bench`` command does, when it runs."""
