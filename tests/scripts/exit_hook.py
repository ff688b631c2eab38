"""A torch job that ends without `end_training`: process 0 normally, process 1 (after process 0
has left) with an uncaught exception. An exit hook registered before the Accelerator's runs after
it and prints whether the process group still exists then (tests/test_exit.py)."""
import atexit
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from unified import Accelerator  # noqa: E402

left, rank = Path(sys.argv[1]), int(os.environ["RANK"])
# Registered before the Accelerator's exit hooks, so these run after them (last in, first out).
atexit.register(lambda: print(f"group at exit: {'still there' if dist.is_initialized() else 'left'}", flush=True))
atexit.register(lambda: left.write_text("1") if rank == 0 else None)

accelerator = Accelerator(timeout=60)
model = torch.nn.Linear(4, 4)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
loss = model(torch.ones(2, 4)).sum()
accelerator.backward(loss)
optimizer.step()
accelerator.wait_for_everyone()
if rank == 1:
    deadline = time.monotonic() + 30
    while not left.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # process 0 is past its exit hooks
    raise RuntimeError("an uncaught error on process 1")
