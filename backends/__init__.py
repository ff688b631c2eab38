"""Framework primitives for `unified`: one package per framework, registered in `unified/backend/registry.py`.

Every backend package has the same modules, one concern each (as Keras 3's backends do), and no
backend imports another; what two backends share lives in `backends/common.py`
(tests/unit/test_backend_shape.py checks both):

- ``__init__.py``: ``SPEC``, read without importing the framework;
- ``core.py``: the Backend class (lifecycle, arrays and their export, RNG, training objects),
  into which the concern modules below are mixed;
- ``tensors.py``: the framework's arrays to and from host memory and checkpoint bytes, the bottom
  module every other one may import (none imports ``core``);
- ``control.py``: the control plane (barrier, flags, small bytes, the health channel);
- ``coordinator.py``: the rendezvous service in a process of its own (``python -m``);
- ``data.py``: prepared loaders and the placement of batches;
- ``loop.py``: the training loop (accumulation, clipping, mixed precision);
- ``sharding.py``: sharded training state and its sharded checkpoints;
- ``storage.py``: the file storage those sharded checkpoints are written through;
- ``launch.py``: ``LAUNCHER``, how `unified launch` starts a group;
- ``env.py``: the lines of ``unified env`` (and global seeding);
- ``private.py``: every private framework API the backend uses, with ``check()``;
- ``testing.py``: the backend's kit for the conformance suite (`unified.testing`).
"""
