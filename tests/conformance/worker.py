"""One process of a test group: run the named scenarios in order, write JSON results.

Scenario functions are looked up in the modules named by ``UNIFIED_TEST_SCENARIOS``
(comma-separated, first match wins; default: this folder's ``scenarios``), so the fault
benchmark (benchmarks/fault_scenarios.py) runs through this same worker.
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    # Every thread's stack in the log when the harness stops a hung process (SIGTERM at its deadline).
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    modules = [importlib.import_module(name) for name in os.environ.get("UNIFIED_TEST_SCENARIOS", "scenarios").split(",")]
    out = Path(os.environ["UNIFIED_TEST_OUT"])
    results: dict = {}
    state: dict = {}

    def flush() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        os.replace(tmp, out)

    for name in sys.argv[1:]:
        function = next(getattr(m, name) for m in modules if hasattr(m, name))
        try:
            results[name] = function(state)
        except BaseException as err:  # noqa: BLE001 - report everything to the parent
            results[name] = {"error": f"{type(err).__name__}: {err}", "unexpected": True,
                             "traceback": traceback.format_exc()}
            flush()
            print(traceback.format_exc(), flush=True)
            return 1
        flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
