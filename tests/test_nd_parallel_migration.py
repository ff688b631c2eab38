"""An Accelerate ND-parallel script runs on unified after changing only its import lines, and
reaches Accelerate's losses.

``tests/migration/nd_parallel_accelerate.py`` is written against Accelerate 1.15 the way its
examples/torch_native_parallelism/nd_parallel.py is (``ParallelismConfig``, an FSDP2 plugin when
``dp_shard_size > 1``, the model split with ``parallelize_module`` before ``prepare`` as Accelerate
expects, the loss averaged over ``torch_device_mesh["dp_cp"]``, ``save_state`` every N steps), with
a tiny causal LM and fixed synthetic tokens. The test rewrites its ``from accelerate... import``
lines (`tests.test_migration.to_unified`), runs the result with ``unified launch --backend torch``
(CPU, gloo) as HSDP x TP on 8 processes (FSDP2 x TP on 4: the conformance suite's
test_parallelism), and compares the losses with Accelerate's, stored below.

The reference: Accelerate 1.15 cannot run a ``ParallelismConfig`` of more than one process on CPU
(``ParallelismConfig is only compatible DistributedType.FSDP (version 2) or
DistributedType.Multi{Device} ...but got DistributedType.MULTI_CPU``: its FSDP and its N-D
parallelism are for accelerators only; and ``tp_size > 1`` needs transformers installed), so it
is the same script under Accelerate on one process with the same global batch of 8 sequences:
``python tests/migration/nd_parallel_accelerate.py`` (ParallelismConfig() sizes 1). Every layout
trains on the same global batches, so its losses are the same up to rounding: measured side by
side, unified on 1 process, TP 4, HSDP 2x2, FSDP2 2 x TP 2 and HSDP 2x2 x TP 2 all printed
Accelerate's 12 losses within 1e-6 (the printed precision). The tolerance, 1e-4, is 100x that,
and 140x smaller than what a 1% change of the learning rate does to the losses (up to 0.0147).
See docs/parallelism.md.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_migration import changed_lines, main_lines, to_unified

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "migration" / "nd_parallel_accelerate.py"
TIMEOUT = 240
TOLERANCE = 1e-4
# Accelerate 1.15 (torch 2.13, CPU), one process, the script's defaults (12 steps, global batch 8)
ACCELERATE_LOSSES = [4.326880, 3.537787, 2.600240, 2.200180, 1.438612, 1.354505,
                     1.434225, 1.507811, 0.961593, 1.231059, 1.694735, 1.105713]
LAYOUTS = {  # id -> (processes, script arguments); dp_shard x tp on 4 processes: the conformance suite's
    "hsdp2x2_tp2": (8, ["--dp-replicate-size", "2", "--dp-shard-size", "2", "--tp-size", "2"]),
}


def test_only_import_lines_change():
    before = SCRIPT.read_text()
    after = to_unified(before)
    assert changed_lines(before, after) == [
        "-from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig",
        "-from accelerate.utils import set_seed",
        "+from unified import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig",
        "+from unified.utils import set_seed",
    ]
    assert not re.search(r"^\s*(from|import)\s+accelerate\b", after, re.M)


def launch(script: Path, cwd: Path, processes: int, *args: str) -> str:
    stub = cwd / "no_accelerate"  # the migrated script must not reach Accelerate
    (stub / "accelerate").mkdir(parents=True, exist_ok=True)
    (stub / "accelerate" / "__init__.py").write_text(
        "raise ImportError('the migrated script must not need accelerate')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub), str(REPO), env.get("PYTHONPATH")]))
    for name in ("UNIFIED_BACKEND", "UNIFIED_LAUNCHER_BACKEND"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "unified", "launch", "-n", str(processes), "--backend", "torch", str(script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output[-6000:]}"
    return output


@pytest.mark.multiprocess
@needs_torch
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_migrated_nd_script_reaches_accelerates_losses(tmp_path, layout):
    processes, args = LAYOUTS[layout]
    script = tmp_path / "nd_parallel.py"
    script.write_text(to_unified(SCRIPT.read_text()))
    save_dir = tmp_path / "outputs"
    lines = main_lines(launch(script, tmp_path, processes, *args, "--save-dir", str(save_dir)))

    # searched, not matched whole: process 0's stderr (a warning) may land before the newline of a
    # line it printed (print writes the text and the newline apart, both streams on one pipe)
    printed = "\n".join(lines)
    by_step = {int(step): float(loss) for step, loss in re.findall(r"Step (\d+)/12, Loss: (\d+\.\d{6})", printed)}
    losses = [by_step[step] for step in sorted(by_step)]
    assert sorted(by_step) == list(range(len(ACCELERATE_LOSSES))), printed
    assert losses[-1] < losses[0] - 2, losses  # it trains
    worst = max(abs(a - b) for a, b in zip(losses, ACCELERATE_LOSSES))
    assert worst <= TOLERANCE, (worst, losses, ACCELERATE_LOSSES)

    # sharded save_state every 4 steps (--checkpoint-frequency), as Accelerate's example
    assert re.findall(r"Saving checkpoint at step \d+\.\.\.", printed) == [
        "Saving checkpoint at step 4...", "Saving checkpoint at step 8..."], printed
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint-4", "checkpoint-8"]
    for checkpoint in save_dir.iterdir():
        shards = list((checkpoint / "sharded.dcp").iterdir())
        assert (checkpoint / "manifest.json").is_file() and len(shards) == processes, (checkpoint, shards)
