import pytest

from unified.registry import available_backends

# Every registered backend whose framework is installed: the built-in ones, and any registered
# through the `unified.backends` entry-point group.
BACKENDS = available_backends()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "conformance" in str(item.fspath) or "multiprocess" in item.keywords:
            item.add_marker(pytest.mark.multiprocess)
