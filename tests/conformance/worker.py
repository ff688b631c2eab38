"""One process of a conformance group: run the named scenarios in order, write JSON results."""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios  # noqa: E402  (a sibling module; this file runs as a script)


def main() -> int:
    out = Path(os.environ["UNIFIED_TEST_OUT"])
    results: dict = {}
    state: dict = {}

    def flush() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        os.replace(tmp, out)

    for name in sys.argv[1:]:
        try:
            results[name] = getattr(scenarios, name)(state)
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
