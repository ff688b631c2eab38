"""The `unified` command: ``unified launch ...`` and ``unified env``."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import launch as launch_module


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``unified`` console script and of ``python -m unified``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # its own parser: the script's arguments are never matched against ours
        return launch_module.main(argv[1:])
    parser = argparse.ArgumentParser(prog="unified", description="One Accelerator for PyTorch and JAX.",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    launch_module.build_parser(commands.add_parser("launch", help="start a multi-process run"))
    commands.add_parser("env", help="print versions and devices for bug reports")
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch_module.launch(args)
    from .report import report

    print(report())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
