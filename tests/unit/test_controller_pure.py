"""Pure parts of the controller: dispatch ownership, Batch, placement config, strict config loading."""

import pytest
import torch

from megarl.config import from_dict
from megarl.controller.dispatch import collect_ranks, dp_members
from megarl.data.batch import Batch
from megarl.errors import ConfigError, LayoutError
from megarl.parallel.layout import ParallelLayout


def test_dp_members_and_owners_hand_worked():
    layout = ParallelLayout(tp=2, pp=2, dp=2)  # ranks: tp fastest, then dp, then pp
    assert dp_members(layout) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert collect_ranks(layout) == [4, 6]  # last PP stage, TP rank 0
    assert collect_ranks(ParallelLayout(tp=2, dp=2)) == [0, 2]
    assert collect_ranks(ParallelLayout(pp=4)) == [3]


def test_batch_pad_chunk_concat_unpad():
    b = Batch.from_dict({"x": torch.arange(10).view(5, 2)}, {"s": list("abcde")}, {"step": 3})
    padded, pad = b.pad_to_multiple(4)
    assert pad == 3 and padded["s"] == list("abcdeabc")
    assert [c["s"] for c in padded.chunk(4)] == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"]]
    back = Batch.concat(padded.chunk(4)).unpad(pad)
    assert torch.equal(back["x"], b["x"]) and back["s"] == b["s"] and back.meta == {"step": 3}
    assert b.pad_to_multiple(5) == (b, 0)
    assert b.select("s").keys() == ["s"] and b.select("x")["x"].shape == (5, 2)
    merged = b.update(Batch.from_dict({"y": torch.ones(5)}))
    assert merged.keys() == ["s", "x", "y"]
    assert b.index([4, 0])["s"] == ["e", "a"]
    assert b.nbytes() == 10 * 8


def test_concat_right_pads_token_fields_of_different_widths():
    # two data-parallel ranks' rollouts, each cut to its own longest row (widths 3 and 5)
    a = Batch.from_dict({"input_ids": torch.tensor([[7, 8, 9]]), "mask": torch.tensor([[1.0, 1.0, 0.0]]),
                         "uid": torch.tensor([0]), "cube": torch.ones(1, 3, 2)}, {"text": ["a"]})
    b = Batch.from_dict({"input_ids": torch.tensor([[1, 2, 3, 4, 5], [6, 6, 0, 0, 0]]),
                         "mask": torch.ones(2, 5), "uid": torch.tensor([1, 2]), "cube": torch.full((2, 5, 2), 2.0)},
                        {"text": ["b", "c"]})
    out = Batch.concat([a, b])
    assert out["input_ids"].tolist() == [[7, 8, 9, 0, 0], [1, 2, 3, 4, 5], [6, 6, 0, 0, 0]]
    assert out["mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert out["uid"].tolist() == [0, 1, 2] and out["text"] == ["a", "b", "c"]
    assert out["cube"].shape == (3, 5, 2) and out["cube"][0, 3:].abs().sum() == 0 and out["cube"][0, :3].sum() == 6
    assert a["input_ids"].shape == (1, 3)  # the inputs are not modified


def test_batch_errors():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        Batch.from_dict({"x": torch.zeros(3)}, {"s": ["a"]})
    b = Batch.from_dict({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="pad_to_multiple"):
        b.chunk(2)
    with pytest.raises(KeyError, match="no field 'y'"):
        b["y"]
    with pytest.raises(ValueError, match="different fields"):
        Batch.concat([b, Batch.from_dict({"z": torch.zeros(1)})])


def test_placement_config_from_dict_and_errors():
    from megarl.controller.spec import Device, PlacementConfig

    cfg = from_dict(PlacementConfig, {
        "pools": {"main": {"devices_per_node": 8, "tp": 4, "pp": 2, "device": "cpu"}},
        "roles": {"policy": "main", "reference": "main"},
    })
    assert cfg.pools["main"].device is Device.CPU and cfg.pools["main"].layout() == ParallelLayout(tp=4, pp=2, dp=1)
    with pytest.raises(ConfigError, match=r"key 'pools.main.devices_per_nod'; did you mean 'devices_per_node'"):
        from_dict(PlacementConfig, {"pools": {"main": {"devices_per_nod": 2}}, "roles": {"policy": "main"}})
    with pytest.raises(ConfigError, match="pool 'mian', which is not defined; did you mean 'main'"):
        from_dict(PlacementConfig, {"pools": {"main": {}}, "roles": {"policy": "mian"}})
    with pytest.raises(ConfigError, match=r"pools\.main\.tp: expected int or 'auto', found 'two'"):
        from_dict(PlacementConfig, {"pools": {"main": {"tp": "two"}}, "roles": {"policy": "main"}})
    with pytest.raises(ConfigError, match=r"pools\.main\.device: 'tpu' is not one of"):
        from_dict(PlacementConfig, {"pools": {"main": {"device": "tpu"}}, "roles": {"policy": "main"}})
    with pytest.raises(LayoutError, match="not divisible by tp\\*pp"):
        from_dict(PlacementConfig, {"pools": {"main": {"devices_per_node": 6, "tp": 4}}, "roles": {"p": "main"}})
    with pytest.raises(ConfigError, match=r"pools \['spare'\] host no role"):
        from_dict(PlacementConfig, {"pools": {"main": {}, "spare": {}}, "roles": {"p": "main"}})


@pytest.mark.parametrize("n, dp", [(5, 4), (1, 2), (8, 4), (7, 3)])
def test_shard_puts_filler_last_and_unpads(n, dp):
    b = Batch.from_dict({"x": torch.arange(n * 2).view(n, 2)}, {"s": [f"r{i}" for i in range(n)]})
    shards, pad = b.shard(dp)
    size = -(-n // dp)
    assert [len(s) for s in shards] == [size] * dp and pad == size * dp - n
    back = Batch.concat(shards).unpad(pad)
    assert torch.equal(back["x"], b["x"]) and back["s"] == b["s"]


def test_pickle_ships_only_the_slice_and_receivers_get_private_tensors():
    import pickle

    big = Batch.from_dict({"x": torch.randn(1000, 256), "h": torch.ones(1000, 4, dtype=torch.bfloat16)})
    part = big.slice(0, 10)
    data = pickle.dumps(part, protocol=5)
    assert len(data) < 20_000  # 10 rows (~10 KiB), not the 1 MiB storage the slice views
    back = pickle.loads(data)
    assert torch.equal(back["x"], big["x"][:10]) and back["h"].dtype == torch.bfloat16

    buffers = []
    payload = pickle.dumps(part, protocol=5, buffer_callback=buffers.append)
    assert buffers  # tensors travel out-of-band (zero-copy for Ray's object store)
    frozen = [memoryview(bytes(b.raw())) for b in buffers]  # read-only, like shared object-store memory
    received = pickle.loads(payload, buffers=frozen)
    received["x"].add_(1.0)  # allowed: the receiver got a private copy
    assert torch.equal(received["x"], big["x"][:10] + 1.0)


def test_a_pool_without_gpus_hides_them_from_its_workers_a_gpu_pool_leaves_them_to_ray():
    """Ray 2.60 sets CUDA_VISIBLE_DEVICES only for actors it gives GPUs to: a CPU pool's workers on a GPU node
    would see every GPU (and build on GPU 0); a GPU pool's must keep the one Ray assigns."""
    from megarl.controller.pools import worker_env

    assert worker_env(use_gpu=False) == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    assert worker_env(use_gpu=True) == {}
