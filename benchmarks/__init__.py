"""The benchmarks: each module is a script run from the repository root as
``python -m benchmarks.<name> [--help]``, which prints markdown tables (the ones quoted in
docs/benchmarks/) and draws its picture into docs/benchmarks/img/.

What they share: `benchmarks.runner` (interleaved rounds, timing, peak memory, statistics,
tables, parts in processes of their own), `benchmarks.plot` (the pictures) and
`benchmarks.checkpointing` (what the checkpoint benchmarks save, load and clean up). The fault
trials are a test suite: ``python -m tests.faults`` (docs/benchmarks/faults.md).
"""
