"""One process of a test group: run the given scenarios in order, write JSON results.

Run as ``python -m unified.testing.worker module:scenario ...`` by `unified.testing.harness`;
each argument names a function decorated with `unified.testing.scenario` (see `reference`).
Results go to the file named by ``UNIFIED_TEST_OUT``, rewritten after every scenario, keyed by
the scenario's name; ``{process}`` in that name stands for the process's index (for groups
started by `unified launch`, where every process gets the same environment).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from unified.backend.registry import load_object
from unified.runtime.environment import ProcessEnvironment
from unified.testing.scenario import requirements


def main() -> int:
    # Every thread's stack in the log when the harness stops a hung process (SIGTERM at its deadline).
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    out = Path(os.environ["UNIFIED_TEST_OUT"].replace("{process}", str(ProcessEnvironment.from_env().process_index)))
    results: dict = {}
    state: dict = {}
    # UNIFIED_TEST_TIMINGS=FOLDER: each scenario's wall and CPU seconds, to see where a group's time goes
    timings_folder = os.environ.get("UNIFIED_TEST_TIMINGS")
    timings: dict = {}

    def flush() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        os.replace(tmp, out)

    for target in sys.argv[1:]:
        function = load_object(target)
        requirements(function)  # only declared scenarios run
        wall, cpu = time.monotonic(), time.process_time()
        try:
            results[function.__name__] = function(state)
        except BaseException as err:  # noqa: BLE001 - report everything to the parent
            results[function.__name__] = {"error": f"{type(err).__name__}: {err}", "unexpected": True,
                                          "traceback": traceback.format_exc()}
            flush()
            print(traceback.format_exc(), flush=True)
            return 1
        flush()
        timings[function.__name__] = [time.monotonic() - wall, time.process_time() - cpu]
        if timings_folder:
            Path(timings_folder, f"{out.stem}-{os.getpid()}.json").write_text(json.dumps(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
