"""Training semantics shared by every backend, run in each worker.

The training loop's rules (`loop`: gradient accumulation, mixed precision, clipping, what a
checkpoint of the loop holds), sharded training (`sharding`: ``fsdp_plugin`` and the sharded
state it saves), parallelism beyond one axis (`parallelism`: ``ParallelismConfig``, its named
mesh and each process's ranks) and metrics gathered exactly once per sample (`metrics`). The experiment
trackers live in `unified.tracking` (Accelerate's module name). A backend supplies the
primitives (`unified.backend`); the rules are written here once.
"""
