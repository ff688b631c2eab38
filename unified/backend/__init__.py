"""The backend contract: what a framework supplies, and how a backend is found.

`base` declares `Backend` (the primitives every backend has) and `HealthChannel`;
`capabilities` the optional capabilities a backend may add (`TrainingObjects`, `ShardedArrays`, ...); `registry` maps
a backend's name to its code (the default entries and the ``unified.backends`` entry points);
`toolkit` is the stable set of helpers a backend author may import (`ProcessEnvironment`,
`Launcher`, `export_numpy`, ...). The classes to subclass are exported here; the conformance
suite that certifies a backend is `unified.testing`. See docs/adding-a-backend.md.

Example:
    >>> from unified.backend import Backend, TrainingObjects, BackendSpec
"""
from .capabilities import (
                           CAPABILITIES,
                           ArrayCollectives,
                           Autograd,
                           Backend,
                           DeferredArray,
                           DeviceMesh,
                           Exported,
                           FileHashes,
                           ForeignLoaders,
                           HealthChannel,
                           KeyStream,
                           Replaceable,
                           ShardedArrays,
                           ShardedLoad,
                           ShardedRead,
                           ShardedTraining,
                           ShardedWrite,
                           TrainingLoop,
                           TrainingObjects,
                           WriteGuards,
                           capabilities_of,
                           check_backend_class,
                           require,
)
from .registry import BackendSpec, available_backends, backend_names, backend_spec

__all__ = ["Backend", "TrainingObjects", "Autograd", "KeyStream", "DeviceMesh", "ArrayCollectives", "ShardedArrays",
           "ShardedLoad", "ShardedRead", "ShardedWrite", "ShardedTraining", "WriteGuards", "ForeignLoaders",
           "TrainingLoop", "CAPABILITIES",
           "Replaceable", "DeferredArray", "Exported", "FileHashes", "capabilities_of", "require",
           "check_backend_class", "HealthChannel", "BackendSpec", "available_backends", "backend_names", "backend_spec"]
