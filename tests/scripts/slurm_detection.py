"""Run by tests through `unified launch` with SLURM's variables set: the launcher's values must
be used as they are, without JAX's cluster detection (which would pin each process to the GPU
numbered SLURM_LOCALID). Reports the process's identity and how often detection ran."""
import json

from jax._src.clusters import ClusterEnv

calls = []
detect = ClusterEnv.auto_detect_unset_distributed_params.__func__


def watched(cls, *args, **kwargs):
    calls.append(repr(args))
    return detect(cls, *args, **kwargs)


ClusterEnv.auto_detect_unset_distributed_params = classmethod(watched)

import unified  # noqa: E402

accelerator = unified.Accelerator(backend="jax", timeout=60)
print("RESULT " + json.dumps({"index": accelerator.process_index, "num": accelerator.num_processes,
                              "detections": calls}), flush=True)
accelerator.end_training()
