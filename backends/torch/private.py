"""Every private torch attribute the torch backend reads, each behind one small function.

torch has no public way to read these (see docs/adding-a-backend.md, "Private framework APIs"),
so each one may change in a torch release. When torch moved one, these functions raise
`BackendUnavailable` saying which torch version changed what, instead of an ``AttributeError``
far from the cause. `check()` probes all of them; tests/unit/test_private_apis.py runs it.

- ``Tensor._version``: the in-place version counter, to tell whether an async save's source
  tensors were edited while they were being written.
- ``RandomSampler._num_samples``: ``None`` when the sampler draws exactly one permutation of
  the dataset (then the loader's order can be reproduced for any process count). Read in
  `backends.common.draws_one_permutation`, which the JAX backend's torch loaders use too.
- ``LRScheduler._step_count``: how often a scheduler stepped (``OneCycleLR`` refuses steps past
  its end, and Accelerate's stepping rule can ask for more).
- ``OptimizedModule._orig_mod``: the module that ``torch.compile`` wrapped.
- ``torch.utils.data._utils.worker._worker_info``: where ``get_worker_info()`` reads a DataLoader
  worker's identity, which `backends.torch_readers` sets so that every worker of every process is
  one reader of an iterable dataset.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from backends.common import draws_one_permutation  # re-exported: check() probes it
from unified.errors import BackendUnavailable, see


def changed(what: str, detail: str) -> BackendUnavailable:
    """The error for a private attribute that this torch version no longer has."""
    return BackendUnavailable(
        f"torch {torch.__version__} changed {what}: {detail}. unified relies on this private torch attribute; "
        "install a tested torch version (`unified env` shows the tested range) or report it."
        + see("private-api-changed")
    )


def tensor_version(tensor: Any) -> int:
    """The tensor's in-place version counter (shared with its ``detach()``-ed views)."""
    try:
        return tensor._version
    except AttributeError as err:
        raise changed("the tensor version counter", "Tensor._version is gone") from err


def scheduler_step_count(scheduler: Any) -> int:
    """How many times ``scheduler.step()`` ran (the constructor's own step included)."""
    try:
        return scheduler._step_count
    except AttributeError as err:
        raise changed("LR schedulers", f"{type(scheduler).__name__}._step_count is gone") from err


def compiled_inner(model: Any) -> Optional[Any]:
    """The module inside a ``torch.compile`` wrapper, or None when ``model`` is not one."""
    return getattr(model, "_orig_mod", None)


def check() -> List[Tuple[str, str]]:
    """Probe every private attribute above on small fresh objects; raise the first change found
    (``_orig_mod`` is probed by tests/unit/test_private_apis.py: importing torch.compile's
    machinery takes seconds). Returns the (name, purpose) rows."""
    tensor_version(torch.zeros(1))
    draws_one_permutation(torch.utils.data.RandomSampler(range(3)))
    from backends.torch_readers import worker_info_slot

    worker_info_slot()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler_step_count(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=2))
    return [
        ("Tensor._version", "edits to a tensor while an async save writes it"),
        ("RandomSampler._num_samples", "a shuffled loader's order, reproducible at any process count"),
        ("LRScheduler._step_count", "no scheduler step past OneCycleLR's end"),
        ("OptimizedModule._orig_mod", "unwrap_model of a torch.compile'd model"),
        ("torch.utils.data._utils.worker._worker_info",
         "every DataLoader worker of every process one reader of a stream"),
    ]
