"""`FullyShardedDataParallelPlugin` checks its fields (Accelerate's names) and `Accelerator`
hands it only to a backend that can shard."""
from __future__ import annotations

import pytest

from unified import FullyShardedDataParallelPlugin
from unified.accelerator import _sharding_backend
from unified.errors import MissingCapability


def test_defaults_pick_the_wrap_policy_from_what_is_given():
    assert FullyShardedDataParallelPlugin().auto_wrap_policy == "no_wrap"
    assert FullyShardedDataParallelPlugin(min_num_params=10).auto_wrap_policy == "size_based_wrap"
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="Block, Attention")
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Attention"]
    assert FullyShardedDataParallelPlugin().state_dict_type == "SHARDED_STATE_DICT"


@pytest.mark.parametrize("fields, message", [
    ({"fsdp_version": 1}, "FSDP2 only"),
    ({"auto_wrap_policy": "everything"}, "auto_wrap_policy='everything'"),
    ({"auto_wrap_policy": "transformer_based_wrap"}, "needs transformer_cls_names_to_wrap"),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type='LOCAL_STATE_DICT'"),
    ({"min_num_params": -1}, "min_num_params=-1"),
])
def test_invalid_fields_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match="fsdp-plugin") as info:
        FullyShardedDataParallelPlugin(**fields)
    assert message in str(info.value)


class _Plain:
    name = "plain"


def test_only_a_plugin_and_only_for_a_backend_that_can_shard():
    assert _sharding_backend(_Plain(), None) is None
    with pytest.raises(TypeError, match="must be a unified.FullyShardedDataParallelPlugin"):
        _sharding_backend(_Plain(), {"fsdp_version": 2})
    with pytest.raises(MissingCapability, match="ShardedTraining"):
        _sharding_backend(_Plain(), FullyShardedDataParallelPlugin())
