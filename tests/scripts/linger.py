"""Run by tests through `unified launch`: record this process and its parent, then stay.

Usage: ``linger.py FOLDER [--ignore-sigterm] [--flood LINES]``. Writes ``FOLDER/<pid>``
holding ``"<pid> <parent pid>"``, prints ``LINES`` lines (default 1), then sleeps. Imports
nothing of unified, so that it starts fast and does not depend on which checkout is installed.
"""
import os
import signal
import sys
import time


def main() -> None:
    folder = sys.argv[1]
    if "--ignore-sigterm" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lines = int(sys.argv[sys.argv.index("--flood") + 1]) if "--flood" in sys.argv else 1
    path = os.path.join(folder, str(os.getpid()))
    with open(path + ".tmp", "w") as file:
        file.write(f"{os.getpid()} {os.getppid()}\n")
    os.replace(path + ".tmp", path)  # complete when seen
    for number in range(lines):
        print(f"line {number} of process {os.getpid()}", flush=lines < 1000)
    sys.stdout.flush()
    time.sleep(300)


if __name__ == "__main__":
    main()
