"""The declared interfaces of the checkpoint pipeline (`unified.checkpoint.types`): a folder and
an object store are both `Location`s (and so `Reader`s), with every method the protocol names
taking the parameters it declares, and the manager's public face is its two verbs."""
from __future__ import annotations

import inspect

import pytest

from unified.checkpoint import types
from unified.checkpoint.manager import CheckpointManager
from unified.checkpoint.store import Folder, ObjectStore, location_of


def _members(protocol: type) -> list:
    return sorted(name for name in dir(protocol) if not name.startswith("_") and callable(getattr(protocol, name)))


@pytest.mark.parametrize("location", [Folder(), ObjectStore("memory://unified-types/run")], ids=["folder", "store"])
def test_folders_and_object_stores_are_locations(location):
    assert isinstance(location, types.Location) and isinstance(location, types.Reader)
    for name in _members(types.Location):
        declared = list(inspect.signature(getattr(types.Location, name)).parameters)
        assert list(inspect.signature(getattr(type(location), name)).parameters) == declared, name
    assert isinstance(location.atomic_replace, bool) and location.report_poll_seconds > 0


def test_location_of_gives_a_location_for_folders_and_urls(tmp_path):
    assert isinstance(location_of(str(tmp_path)), types.Location)
    assert isinstance(location_of("memory://unified-types/run"), types.Location)


def test_the_manager_has_two_verbs():
    assert list(inspect.signature(CheckpointManager.save).parameters)[:2] == ["self", "output_dir"]
    assert list(inspect.signature(CheckpointManager.load).parameters)[:2] == ["self", "input_dir"]
