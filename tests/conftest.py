import importlib.util

import pytest

BACKENDS = [b for b in ("torch", "jax") if importlib.util.find_spec(b) is not None]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "conformance" in str(item.fspath) or "multiprocess" in item.keywords:
            item.add_marker(pytest.mark.multiprocess)
