"""Benchmarks of the runtime core. Run one with ``python -m benchmarks.<name> [--quick] [--json PATH]``."""
