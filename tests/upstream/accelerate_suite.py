"""Issue 50's measure: Accelerate 1.15's own tests and launched scripts, run once against
Accelerate and once against unified with only the public names a script imports switched.

    python -m tests.upstream.accelerate_suite              # every file below, a table at the end
    python -m tests.upstream.accelerate_suite --only test_sync.py --verbose

A measurement, not a test: pytest does not collect this module (CI runs
``tests/test_accelerate_upstream.py``, the one file fast enough for it). It needs the ``peers``
extra (accelerate==1.15.0, parameterized), torch and torchrun, and takes several minutes.

What runs
---------
* Pytest files: verbatim copies of Accelerate 1.15.0's ``tests/*.py`` (the ``accelerate-1.15.0.tar.gz``
  sdist), kept here as ``accelerate_1_15_<name>.py`` with their sha256 in README.md (checked
  before every run). Each is run twice by pytest in a temporary folder: as it is, and with the
  import lines named in `PYTEST_FILES` rewritten (each must occur exactly once).
* Launched scripts: ``accelerate/test_utils/scripts/<name>`` of the installed Accelerate, run on
  two CPU processes by ``torchrun --nproc-per-node 2`` through `tests.upstream.launched_runner`
  (each ``test_*``/``check_*``/``*_check`` call recorded; a test passes when it passes on both
  processes). ``ACCELERATE_USE_CPU=1`` on both sides: without it Accelerate 1.15 on a machine
  without GPUs ignores torchrun's variables and runs every process alone.

What counts (a *fair* test)
---------------------------
A test counts when it goes through a switched name (so that its outcome depends on which
library serves it), it passes on Accelerate 1.15 here, and it does not reach into Accelerate's
internals. Left out, with the reason:

* tests that never touch a switched name (``BatchSamplerShard``, ``DataLoaderShard``,
  ``DataLoaderDispatcher``, ``SkipDataLoader``, ``IterableDatasetShard`` constructed directly,
  ``prepare_data_loader(num_processes=...)``, Accelerate's offload utilities): they would pass
  identically on both sides and measure nothing of unified - most of ``test_data_loader.py``;
* tests that read or patch Accelerate's private state: ``AcceleratorState._reset_state`` /
  ``PartialState._shared_state`` (``test_partial_state_after_reset``,
  ``test_accelerator_state_after_reset``, ``test_script.py``'s ``test_reinstantiated_state``),
  ``accelerator._dataloaders`` / ``_models`` lists (``test_prepared_objects_are_referenced*``,
  ``test_free_memory_dereferences_prepared_components``), ``isinstance(.., DataLoaderShard /
  DataLoaderDispatcher)`` on what prepare returned, the ``batch_sampler.even_batches`` attribute
  of Accelerate's sampler shards (``test_join_can_override_*``), the CPU-affinity and
  ``ACCELERATE_TORCH_DEVICE`` plumbing, the names of Accelerate's own hook objects;
* ``test_can_pickle_dataloader``: unified refuses pickle (docs/migration.md);
* tests of the trackers unified does not provide (Aim, ClearML, Comet, DVCLive, SwanLab,
  Trackio) and those that need the network (W&B's service).

* ``test_distributed_data_loop.py``'s ``test_can_join_uneven_inputs`` is not run on Accelerate's
  side: Accelerate 1.15 joins on GPUs only, so on CPU processes its DDP backward waits for ever
  (it runs, and passes, on unified's side, which joins on CPU groups too).

The table gives, per file: how many fair tests pass on Accelerate, how many of those on
unified, those that fail on unified by a deliberate difference listed in docs/migration.md
(``differs``: the reason is printed with ``--verbose``), and the others, which are to be fixed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PREFIX = "accelerate_1_15_"


@dataclass(frozen=True)
class Upstream:
    """One of Accelerate's files: what is rewritten, and which of its tests count.

    ``fair``: regular expressions over the test ids (``Class::test`` for pytest files, the
    function name for launched scripts); a test counts when one matches and no ``excluded``
    one does (``excluded`` maps a regular expression to the reason)."""

    name: str
    swaps: Tuple[Tuple[str, str], ...]
    fair: Tuple[str, ...] = (r".*",)
    excluded: Dict[str, str] = field(default_factory=dict)
    # fair tests that fail on unified by a deliberate difference listed in docs/migration.md: pattern -> why
    differs: Dict[str, str] = field(default_factory=dict)
    launched: bool = False
    recorded: str = "test_.*"  # a launched script's functions recorded (`tests.upstream.launched_runner`)
    # a launched script's functions not run on Accelerate's side (they hang there): name pattern -> why
    hang_on_accelerate: Dict[str, str] = field(default_factory=dict)

    def counts(self, test_id: str) -> bool:
        return (any(re.fullmatch(p, test_id) for p in self.fair)
                and not any(re.fullmatch(p, test_id) for p in self.excluded))


_INTERNAL_STATE = "reads or resets Accelerate's private state (_reset_state, _shared_state)"
_NO_SWITCHED_NAME = "constructs Accelerate's loader classes directly: no switched name"

PYTEST_FILES: Tuple[Upstream, ...] = (
    Upstream("test_state_checkpointing.py", (
        ("from accelerate import Accelerator\n", "from unified import Accelerator\n"),
        ("from accelerate.utils import DistributedType, ProjectConfiguration, patch_environment, set_seed\n",
         "from accelerate.utils import DistributedType, patch_environment, set_seed\n"
         "from unified import ProjectConfiguration\n"),
    )),
    Upstream("test_scheduler.py", (
        ("from accelerate import Accelerator, debug_launcher\n",
         "from accelerate import debug_launcher\nfrom unified import Accelerator\n"),
        ("from accelerate.utils import GradientAccumulationPlugin\n",
         "from unified.utils import GradientAccumulationPlugin\n"),
    )),
    Upstream("test_accelerator.py", (
        ("from accelerate.accelerator import Accelerator\n", "from unified import Accelerator\n"),
        ("from accelerate.utils.dataclasses import DataLoaderConfiguration\n",
         "from unified.utils import DataLoaderConfiguration\n"),
    ), excluded={
        r".*::test_partial_state_after_reset": _INTERNAL_STATE,
        r".*::test_accelerator_state_after_reset": _INTERNAL_STATE,
        r".*::test_mutable_states": "reads Accelerate's GradientState() singleton (and _reset_state)",
        r".*::test_prepare_model_8bit_cpu_offload.*": "patches accelerate.accelerator's bitsandbytes checks "
                                                     "(8-bit models: not supported by unified)",
        r".*::test_setting_cpu_affinity": "Accelerate's NUMA-affinity plumbing (ACCELERATE_CPU_AFFINITY)",
        r".*::test_env_var_device": "ACCELERATE_TORCH_DEVICE, an Accelerate launcher variable",
        r".*::test_prepared_objects_are_referenced.*": "reads accelerator._models/_optimizers/_dataloaders",
        r".*::test_free_memory_dereferences_prepared_components": "reads accelerator._models/_dataloaders",
        r".*::test_can_pickle_dataloader.*": "pickle: unified refuses it (docs/migration.md)",
        r".*::test_get_state_dict_from_offload.*": "Accelerate's offload utility only: no switched name",
        r".*::test_nested_hook": "checks the class of Accelerate's own model hooks",
        r".*bnb.*|.*_te\b.*|.*::test_can_unwrap_model_fp16": "needs a GPU (bitsandbytes, fp16, TE)",
    }, differs={
        r".*::test_is_accelerator_prepared": "prepare() of an object it cannot prepare (a list) is a TypeError "
                                            "(migration.md: What is not covered)",
    }),
    Upstream("test_data_loader.py", (
        ("from accelerate import Accelerator, PartialState\n",
         "from accelerate import PartialState\nfrom unified import Accelerator\n"),
    ), fair=(r".*::test_iterable_dataset_with_non_tensor_samples", r".*::test_set_epoch_in_batch_sampler",
             r".*::test_stateful_dataloader_adapter_equivalent_to_torchdata_stateful_dataloader.*"),
        excluded={r".*::test_stateful_dataloader_adapter.*": _NO_SWITCHED_NAME + " (Accelerator() only built)"}),
    Upstream("test_tracking.py", (
        ("from accelerate import Accelerator\n", "from unified import Accelerator\n"),
        ("    register_tracker_class,\n)\n",
         "    register_tracker_class,\n)\nfrom unified.tracking import (  # noqa: F811\n"
         "    LOGGER_TYPE_TO_CLASS, GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker, "
         "register_tracker_class)\n"),
        ("from accelerate.utils import (\n    ProjectConfiguration,\n",
         "from unified import ProjectConfiguration\nfrom accelerate.utils import (\n"),
    ), fair=(r"TensorBoardTrackingTest::.*", r"MLflowTrackingTest::.*", r"CustomTrackerTestCase::.*",
             r"RegisterTrackerClassTest::.*", r"TrackerDeferredInitializationTest::test_(tensorboard|mlflow)_.*",
             r"WandBTrackingTest::.*"),
        excluded={r"WandBTrackingTest::.*": "needs W&B's service (network)",
                  r"TrackerDeferredInitializationTest::.*": "reads PartialState._shared_state (Accelerate's private "
                                                            "state)"}),
    Upstream("test_kwargs_handlers.py", (
        ("from accelerate import Accelerator, DistributedDataParallelKwargs, GradScalerKwargs\n",
         "from unified import Accelerator, DistributedDataParallelKwargs, GradScalerKwargs\n"),
        ("    KwargsHandler,\n", ""),
        ("from accelerate.utils.dataclasses import DistributedType\n",
         "from accelerate.utils.dataclasses import DistributedType\nfrom unified.utils import KwargsHandler\n"),
    ), fair=(r".*::test_kwargs_handler",)),
)

_SCRIPT_IMPORTS = ("from unified import Accelerator\n"
                   "from unified.utils import DataLoaderConfiguration, GradientAccumulationPlugin\n")
LAUNCHED_SCRIPTS: Tuple[Upstream, ...] = (
    Upstream("test_sync.py", (
        ("from accelerate.accelerator import Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin\n",
         _SCRIPT_IMPORTS),
    ), launched=True),
    Upstream("test_distributed_data_loop.py", (
        ("from accelerate.accelerator import Accelerator, DataLoaderConfiguration\n", _SCRIPT_IMPORTS),
    ), launched=True, excluded={
        r"test_join_can_override_(even_batches|for_mixed_type_dataloaders)":
            "reads batch_sampler.even_batches, an attribute of Accelerate's BatchSamplerShard",
        r"test_pickle_accelerator": "pickle: unified refuses it (docs/migration.md)",
        r"test_join_raises_warning_for_non_ddp_distributed":
            "assigns accelerator.state.distributed_type to act as an FSDP run",
    }, hang_on_accelerate={
        r"test_can_join_uneven_inputs": "Accelerate 1.15 joins on GPUs only (multi_device leaves MULTI_CPU out): on "
                                        "CPU its DDP backward waits for the process that ran out, for ever",
    }),
    Upstream("test_script.py", (
        ("from accelerate import Accelerator\n", "from unified import Accelerator\n"),
        ("    DataLoaderConfiguration,\n", ""),
        ("from accelerate.state import AcceleratorState\n",
         "from accelerate.state import AcceleratorState\nfrom unified.utils import DataLoaderConfiguration\n"),
    ), launched=True, excluded={
        r"test_reinstantiated_state": _INTERNAL_STATE,
        r"init_state_check": "reads Accelerate's AcceleratorState() singleton, which unified does not set up",
        r"check_seedable_sampler_in_batch_sampler_shard": "builds Accelerate's BatchSamplerShard directly",
    }, differs={
        r"training_check": "the shuffle order of a prepared loader is unified's (seed, epoch), not the loader's "
                           "generator (migration.md: Shuffle order)",
        r"training_check#1": "DataLoaderConfiguration(split_batches=True) without dispatch_batches=True is refused "
                             "(migration.md: split_batches)",
    }, recorded=r"test_.*|.*_check|check_seedable_sampler.*"),
)


@dataclass
class Outcome:
    """One side's run of one file: test id -> passed, and what went wrong outside the tests."""

    results: Dict[str, bool] = field(default_factory=dict)
    failures: Dict[str, str] = field(default_factory=dict)
    trouble: str = ""


def upstream_source(spec: Upstream) -> str:
    """The file as Accelerate 1.15 has it (a pytest file: the verbatim copy here, its sha256 checked
    against README.md; a launched script: the installed package's)."""
    if spec.launched:
        import accelerate

        return (Path(accelerate.__file__).parent / "test_utils" / "scripts" / spec.name).read_text()
    copy = HERE / f"{PREFIX}{spec.name}"
    digest = hashlib.sha256(copy.read_bytes()).hexdigest()
    if digest not in (HERE / "README.md").read_text():
        raise SystemExit(f"{copy.name}: sha256 {digest} is not the one README.md records")
    return copy.read_text()


def switched(source: str, spec: Upstream) -> str:
    """``source`` with exactly ``spec.swaps`` applied, each once."""
    for before, after in spec.swaps:
        if source.count(before) != 1:
            raise SystemExit(f"{spec.name}: the line {before!r} occurs {source.count(before)} times, not once")
        source = source.replace(before, after)
    return source


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNIFIED_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["ACCELERATE_USE_CPU"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_pytest(path: Path, timeout: float) -> Outcome:
    report = path.with_suffix(".xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           f"--junitxml={report}", "-o", "junit_family=xunit1", str(path)]
    try:
        proc = subprocess.run(cmd, cwd=path.parent, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(trouble=f"timed out after {timeout:.0f} s")
    outcome = Outcome()
    if not report.exists():
        outcome.trouble = (proc.stdout + proc.stderr)[-2000:]
        return outcome
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        problems = [c for c in case if c.tag in ("failure", "error")]
        if any(c.tag == "skipped" for c in case):
            continue
        outcome.results[test_id] = not problems
        if problems:
            outcome.failures[test_id] = (problems[0].get("message") or "").replace("\n", " | ")[:240]
    return outcome


_RESULT = re.compile(r"^RESULT (\d+) (\S+) (ok|FAIL)(?: (.*))?$")  # (SKIP lines: not run, not counted)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launched(path: Path, timeout: float, recorded: str, skip: str) -> Outcome:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / "launched_runner.py"), str(path), recorded, skip]
    results = path.parent / f"{path.stem}-results"
    results.mkdir()
    env = {**_env(), "SUITE_RESULTS_DIR": str(results)}
    try:
        proc = subprocess.run(cmd, cwd=path.parent, env=env, capture_output=True, text=True, timeout=timeout)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        proc = None
    outcome = Outcome()
    ranks: Dict[str, Dict[str, bool]] = {}
    for line in [ln for f in sorted(results.glob("results-*.txt")) for ln in f.read_text().splitlines()]:
        m = _RESULT.match(line.strip())
        if m:
            rank, name, verdict, detail = m.groups()
            ranks.setdefault(name, {})[rank] = verdict == "ok"
            if verdict == "FAIL":
                outcome.failures.setdefault(name, f"rank {rank}: {detail}")
    for name, seen in ranks.items():
        outcome.results[name] = len(seen) == 2 and all(seen.values())
        if len(seen) != 2 and name not in outcome.failures:
            outcome.failures[name] = f"reported by {len(seen)} of 2 processes"
    if proc is None:
        outcome.trouble = f"timed out after {timeout:.0f} s"
    elif proc.returncode != 0 and not outcome.results.get("<main>"):
        tail = [ln for ln in output.splitlines() if "Error" in ln or "error" in ln]
        outcome.trouble = f"exit {proc.returncode}: " + (tail[-1] if tail else output[-300:])
    return outcome


@dataclass
class Row:
    name: str
    fair: List[str]
    accelerate: List[str]
    unified: List[str]
    failing: Dict[str, str]
    documented: Dict[str, str]
    trouble: str


def measure(spec: Upstream, folder: Path, timeout: float) -> Row:
    source = upstream_source(spec)
    sides = {}
    for side, text in (("accelerate", source), ("unified", switched(source, spec))):
        path = folder / side / spec.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        skip = "|".join(spec.hang_on_accelerate) if side == "accelerate" else ""
        sides[side] = run_launched(path, timeout, spec.recorded, skip) if spec.launched else run_pytest(path, timeout)
    acc, uni = sides["accelerate"], sides["unified"]
    fair = sorted(t for t in set(acc.results) | set(uni.results) if spec.counts(t) and t != "<main>")
    on_acc = [t for t in fair if acc.results.get(t)]
    on_uni = [t for t in on_acc if uni.results.get(t)]
    failing = {t: uni.failures.get(t, "not run") for t in on_acc if t not in on_uni}
    documented = {t: why for t in list(failing) for pattern, why in spec.differs.items() if re.fullmatch(pattern, t)}
    for test in documented:
        del failing[test]
    trouble = "; ".join(f"{s}: {o.trouble}" for s, o in sides.items() if o.trouble)
    return Row(spec.name, fair, on_acc, on_uni, failing, documented, trouble)


def table(rows: Sequence[Row], verbose: bool) -> str:
    lines = ["| file | fair tests passing on Accelerate 1.15 | of those, passing on unified | documented "
             "differences | failing on unified |", "|---|---|---|---|---|"]
    for row in rows:
        failing = ", ".join(row.failing) or "-"
        documented = ", ".join(row.documented) or "-"
        lines.append(f"| {row.name} | {len(row.accelerate)} | {len(row.unified)} | {documented} | {failing} |")
    total_acc = sum(len(r.accelerate) for r in rows)
    total_uni = sum(len(r.unified) for r in rows)
    total_doc = sum(len(r.documented) for r in rows)
    total_fail = sum(len(r.failing) for r in rows)
    lines.append(f"| **all** | {total_acc} | {total_uni} | {total_doc} | {total_fail} |")
    for row in rows:
        if row.trouble:
            lines.append(f"\n{row.name}: {row.trouble}")
        if verbose:
            for test, why in {**row.failing, **row.documented}.items():
                lines.append(f"\n{row.name} {test}: {why}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run only this file (repeatable), e.g. test_sync.py")
    parser.add_argument("--verbose", action="store_true", help="print why each failing test failed")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per file and side")
    args = parser.parse_args(argv)
    specs = [s for s in PYTEST_FILES + LAUNCHED_SCRIPTS if not args.only or s.name in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="accelerate-suite-") as folder:
        for spec in specs:
            print(f"running {spec.name} ...", file=sys.stderr, flush=True)
            rows.append(measure(spec, Path(folder), args.timeout))
    print(table(rows, args.verbose))
    return 0 if all(not r.failing and not r.trouble for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
