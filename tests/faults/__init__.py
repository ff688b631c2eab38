"""The fault trials: dead processes, crashed saves, damaged and hostile checkpoints, full disk,
preemption, lost machines and stores, restarts, each repeated in real process groups with pass
counts (docs/benchmarks/faults.md). ``python -m tests.faults [--short] [--rows 1,2,...]``;
`tests/test_faults_short.py` runs a short version in CI. `trials` runs and judges them,
`scenarios` holds what the worker processes do.
"""
