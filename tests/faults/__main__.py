"""``python -m tests.faults``: see `tests.faults.trials`."""
import sys

from tests.faults.trials import main

sys.exit(main())
