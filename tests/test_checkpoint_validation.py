"""Damaged or mismatched sharded checkpoints: every rank raises a clear error, and nothing is loaded anywhere.

Each test saves a small two-unit model on 2 ranks, spoils the checkpoint one way, and loads it into a
model with other values: every rank must raise (the ranks agree before anyone writes, so none waits
for another) and keep its values; the rank whose file is bad names the file and what is wrong.
"""

import copy
import json
import os

import pytest
import torch
from torch import nn

from fsdp_course.fsdp.api import FSDP
from fsdp_course.runtime.simulate import run_ranks

WRAP = {nn.Linear}


class Net(nn.Module):
    def __init__(self, buffer_len: int = 3) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(buffer_len))


def save(directory, buffer_len=3):
    torch.manual_seed(0)
    base = Net(buffer_len)
    run_ranks(lambda ctx: FSDP(copy.deepcopy(base), ctx, wrap=WRAP).save_sharded(str(directory)), 2)


def load_everywhere(directory, buffer_len=3):
    """Per rank: the exception load_sharded raised (None if none) and whether the model kept its values."""
    torch.manual_seed(1)
    other = Net(buffer_len)
    with torch.no_grad():
        other.scale.fill_(5.0)

    def rank_fn(ctx):
        fsdp = FSDP(copy.deepcopy(other), ctx, wrap=WRAP)
        before = fsdp.full_state_dict()
        try:
            fsdp.load_sharded(str(directory))
            error = None
        except Exception as exc:  # the test inspects it
            error = exc
        after = fsdp.full_state_dict()  # a collective: it would hang if a rank were left waiting
        return error, all(torch.equal(before[k], after[k]) for k in before)
    return run_ranks(rank_fn, 2, timeout=20)


def assert_refused(results, bad_rank, *words):
    for rank, (error, unchanged) in enumerate(results):
        assert error is not None, f"rank {rank} loaded the spoiled checkpoint without an error"
        assert unchanged, f"rank {rank}'s model changed although the load failed"
        if rank == bad_rank:
            for w in words:
                assert w in str(error), f"rank {rank}: {w!r} not in {error}"
        else:
            assert f"rank(s) [{bad_rank}] found a problem" in str(error), str(error)


def test_a_good_checkpoint_loads(tmp_path):
    save(tmp_path)
    assert [error for error, _ in load_everywhere(tmp_path)] == [None, None]


def test_swapped_rank_files_are_refused(tmp_path):
    save(tmp_path)
    os.rename(tmp_path / "shard_rank0.pt", tmp_path / "tmp.pt")
    os.rename(tmp_path / "shard_rank1.pt", tmp_path / "shard_rank0.pt")
    os.rename(tmp_path / "tmp.pt", tmp_path / "shard_rank1.pt")
    for rank, (error, unchanged) in enumerate(load_everywhere(tmp_path)):
        assert error is not None and unchanged
        assert f"shard_rank{rank}.pt holds rank {1 - rank}'s shards, not rank {rank}'s" in str(error)
        assert "swapped or renamed" in str(error)


@pytest.mark.parametrize("saved_len", [1, 2])  # (1,) into (3,) broadcast silently; (2,) failed after the shards
def test_a_buffer_of_another_shape_is_refused_before_anything_is_written(tmp_path, saved_len):
    save(tmp_path, buffer_len=saved_len)
    for error, unchanged in load_everywhere(tmp_path, buffer_len=3):
        assert isinstance(error, ValueError) and unchanged
        assert f"buffer 'scale' was saved as torch.float32 ({saved_len},), this model has torch.float32 (3,)" \
            in str(error)


def test_a_truncated_file_is_named_and_refused_on_every_rank(tmp_path):
    save(tmp_path)
    path = tmp_path / "shard_rank1.pt"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    assert_refused(load_everywhere(tmp_path), 1, "shard_rank1.pt is", f"save_sharded wrote {size}", "truncated")


def test_flipped_bytes_are_caught_by_the_checksum(tmp_path):
    save(tmp_path)
    path = tmp_path / "shard_rank0.pt"
    data = bytearray(path.read_bytes())
    shard = torch.load(path, weights_only=True)["shards"][0]
    at = data.find(shard.numpy().tobytes())  # the tensor's raw bytes inside the file
    assert at > 0
    data[at + 5] ^= 0x10  # one bit of one float: the file still loads, with another value
    path.write_bytes(bytes(data))
    assert_refused(load_everywhere(tmp_path), 0, "shard_rank0.pt is corrupted", "sha256")


def test_bad_metadata_json_names_the_file(tmp_path):
    save(tmp_path)
    text = (tmp_path / "metadata.json").read_text()
    (tmp_path / "metadata.json").write_text(text[: len(text) // 2])
    for error, unchanged in load_everywhere(tmp_path):
        assert isinstance(error, ValueError) and unchanged
        assert "metadata.json is not valid JSON" in str(error) and "save it again" in str(error)
    (tmp_path / "metadata.json").write_text(json.dumps({"world_size": 2}))  # e.g. an older format
    for error, _ in load_everywhere(tmp_path):
        assert "is not the metadata of a fsdp_course.sharded/2 checkpoint" in str(error)


def test_a_full_state_dict_with_a_wrong_buffer_shape_changes_nothing() -> None:
    """load_full_state_dict checks every shape first: a (1,) buffer is not broadcast into a (3,) one."""
    from fsdp_course.fsdp.state_dict import full_state_dict, load_full_state_dict

    torch.manual_seed(0)
    base = Net()

    def fn(ctx):
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap=WRAP)
        before = full_state_dict(fsdp)
        bad = dict(before)
        bad["scale"] = torch.ones(1)
        with pytest.raises(ValueError, match="scale: \\(1,\\), the model's is \\(3,\\)"):
            load_full_state_dict(fsdp, bad)
        after = full_state_dict(fsdp)
        return all(torch.equal(before[k], after[k]) for k in before)

    assert all(run_ranks(fn, 2))


class Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(4, 3)  # same units, another size


def test_another_size_names_the_parameter_and_its_shapes(tmp_path):
    save(tmp_path)

    def fn(ctx):
        with pytest.raises(ValueError) as raised:
            FSDP(Wider(), ctx, wrap=WRAP).load_sharded(str(tmp_path))
        return str(raised.value)

    said = run_ranks(fn, 2)[0]
    assert "in unit 'b', b.weight was saved with shape (2, 4), here b.weight has (3, 4)" in said


def test_an_adamw_checkpoint_into_sgd_is_refused_before_loading(tmp_path):
    torch.manual_seed(0)
    base = Net()

    def fn(ctx):
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap=WRAP)
        adamw = torch.optim.AdamW(fsdp.parameters(), lr=0.1)
        for p in fsdp.parameters():
            p.grad = torch.ones_like(p)
        adamw.step()
        fsdp.save_sharded(str(tmp_path), adamw)
        sgd = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(ValueError) as raised:
            fsdp.load_sharded(str(tmp_path), sgd)
        return str(raised.value), dict(sgd.state)

    said, state = run_ranks(fn, 2)[0]
    assert "the saved optimizer had the options ['amsgrad', 'betas'," in said
    assert "this SGD has ['dampening', 'momentum', 'nesterov'] instead: build the optimizer that saved it" in said
    assert state == {}
