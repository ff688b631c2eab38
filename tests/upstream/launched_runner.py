"""Run one of Accelerate's launched test scripts with its test functions recorded: started by
`tests.upstream.accelerate_suite` under ``torchrun``, never by pytest.

Each call of a module-level function whose name matches the pattern given (``test_.*`` unless
told otherwise) records ``RESULT <rank> <name> ok`` or ``RESULT <rank> <name> FAIL <error>`` and
returns None instead of raising, so one failure does not hide the tests the script's ``main()``
runs after it (the n-th call of one function is named ``name#n``). Functions matching the optional
third argument are not run (``RESULT <rank> <name> SKIP``). The lines go to
``$SUITE_RESULTS_DIR/results-<rank>.txt`` when that is set (the processes' shared stdout can splice
two lines into one), else to stdout. The script itself is loaded from the path given, exactly as
written there.

Example:
    torchrun --nproc-per-node 2 tests/upstream/launched_runner.py /tmp/x/test_sync.py 'test_.*'
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import traceback
from typing import Any, Callable, Dict


def _report(line: str) -> None:
    folder = os.environ.get("SUITE_RESULTS_DIR")
    if not folder:
        print(line, flush=True)
        return
    with open(os.path.join(folder, f"results-{os.environ.get('RANK', '0')}.txt"), "a") as out:
        out.write(line + "\n")


def _recorded(name: str, fn: Callable[..., Any], calls: Dict[str, int], rank: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        n = calls.get(name, 0)
        calls[name] = n + 1
        key = f"{name}#{n}" if n else name
        try:
            out = fn(*args, **kwargs)
        except BaseException as err:  # noqa: B036 - recorded, the script goes on
            msg = "".join(traceback.format_exception_only(type(err), err)).strip().replace("\n", " | ")[:300]
            _report(f"RESULT {rank} {key} FAIL {msg}")
            return None
        _report(f"RESULT {rank} {key} ok")
        return out
    return inner


def _skipped(name: str, rank: str) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> None:
        _report(f"RESULT {rank} {name} SKIP")
    return inner


def main(path: str, pattern: str = "test_.*", skip: str = "") -> None:
    spec = importlib.util.spec_from_file_location("accelerate_launched_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rank, calls = os.environ.get("RANK", "0"), {}
    for name in list(vars(module)):
        if skip and re.fullmatch(skip, name):
            setattr(module, name, _skipped(name, rank))
        elif re.fullmatch(pattern, name) and callable(getattr(module, name)):
            setattr(module, name, _recorded(name, getattr(module, name), calls, rank))
    module.main()
    _report(f"RESULT {rank} <main> ok")


if __name__ == "__main__":
    main(*sys.argv[1:4])
