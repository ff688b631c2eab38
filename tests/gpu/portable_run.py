"""One process of tests/gpu/test_device_portability.py: train a backend's conformance kit two
steps and save, or load a checkpoint and take one more step; prints one JSON line.

    python tests/gpu/portable_run.py BACKEND save|load PATH
"""
from __future__ import annotations

import json
import sys
import warnings


def main(backend: str, mode: str, path: str) -> None:
    from unified import Accelerator
    from unified.testing.kit import kit_of

    acc = Accelerator(backend=backend)
    training = kit_of(backend).training(acc)
    device = acc.device
    info = {"platform": getattr(device, "platform", None) or device.type}
    if mode == "save":
        training.step()
        training.step()
        acc.save_state(path)
        info["hash"] = training.param_hash()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.load_state(path)
        info["hash"] = training.param_hash()
        info["warnings"] = [str(w.message) for w in caught]
        training.step()  # the training goes on, on the other kind of device
    acc.end_training()
    print(json.dumps(info))


if __name__ == "__main__":
    main(*sys.argv[1:4])
