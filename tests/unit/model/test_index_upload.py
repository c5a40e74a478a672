"""One host→device copy per forward: the index pack, the staging buffer, the RoPE table per device."""

from __future__ import annotations

from array import array

import torch

from replica.model.config import ModelConfig
from replica.model.kv_pages import HostStaging, IndexPack, PagedKVCache
from replica.model.rope import cos_sin, inverse_frequencies, rotation_rows, rotation_table, signed_sin


def _config() -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 16,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        }
    )


def test_pack_gives_each_list_back_as_a_view_of_one_upload() -> None:
    cache = PagedKVCache.for_model(_config(), 4, 4, torch.float32)
    pack = IndexPack()
    first, empty, last = pack.add([3, 1, 4]), pack.add([]), pack.add([2**40, -5])
    pieces = pack.upload(cache)
    assert [p.tolist() for p in pieces] == [[3, 1, 4], [], [2**40, -5]]
    assert (first, empty, last) == (0, 1, 2)
    base = pieces[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in pieces)  # one buffer, no copies


def test_staging_on_the_cpu_copies_nothing_and_writes_in_place() -> None:
    staging = HostStaging(torch.device("cpu"))
    values = array("q", [7, 8, 9])
    uploaded = staging.upload(values)
    assert uploaded.tolist() == [7, 8, 9] and uploaded.data_ptr() == values.buffer_info()[0]
    target = torch.full((5,), -1, dtype=torch.int64)
    address = target.data_ptr()
    staging.copy_into(array("q", [1, 2]), target)
    assert target.tolist() == [1, 2, -1, -1, -1] and target.data_ptr() == address
    assert staging.upload(array("q")).shape == (0,)


def test_rotation_table_is_memoised_per_device_and_matches_cos_sin() -> None:
    config = _config()
    cpu = torch.device("cpu")
    table = rotation_table(config, torch.float32, 256, cpu)
    assert rotation_table(config, torch.float32, 256, cpu) is table
    inv_freq, scale = inverse_frequencies(config)
    positions = torch.tensor([0, 5, 255])
    cos, sin = cos_sin(inv_freq, scale, positions, torch.float32)
    assert torch.equal(table[positions, 0], cos) and torch.equal(table[positions, 1], signed_sin(sin))
    rows_cos, rows_sin = rotation_rows(config, positions, torch.float32, highest=256)
    assert torch.equal(rows_cos[:, 0], cos) and torch.equal(rows_sin[:, 0], signed_sin(sin))
