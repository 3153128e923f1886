import itertools

import numpy as np
import pytest
import torch

from fp8train.data import GlobalBatchSampler, PackedDataset, collate, rank_slice


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_epochs_are_seeded_permutations_and_every_step_is_full():
    sampler = GlobalBatchSampler(num_samples=10, global_batch=4, seed=7)
    batches = _take(sampler, 10)  # 40 indices = 4 epochs
    assert all(len(b) == 4 for b in batches)
    stream = sum(batches, [])
    epochs = [stream[i : i + 10] for i in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # a fresh order each epoch
    assert batches[2] == epochs[0][8:] + epochs[1][:2]  # a batch straddles the epoch boundary
    assert sampler.step == 10


def test_deterministic_for_a_seed():
    a, b, c = (_take(GlobalBatchSampler(100, 8, seed=s), 30) for s in (1, 1, 2))
    assert a == b and a != c


def test_batch_larger_than_dataset():
    batches = _take(GlobalBatchSampler(num_samples=3, global_batch=7, seed=0), 3)
    stream = sum(batches, [])
    assert all(len(b) == 7 for b in batches)
    assert all(sorted(stream[i : i + 3]) == [0, 1, 2] for i in range(0, 21, 3))


def test_resume_continues_exactly():
    full = _take(GlobalBatchSampler(37, 5, seed=3), 20)
    first = GlobalBatchSampler(37, 5, seed=3)
    done = []
    for indices in first:
        done.append(indices)
        if len(done) == 9:
            state = first.state_dict()  # checkpoint while step 8 trains
            break
    resumed = GlobalBatchSampler(37, 5, seed=3)
    resumed.load_state_dict(state)
    assert done + _take(resumed, 11) == full
    assert resumed.batch(4) == full[4]
    with pytest.raises(ValueError, match="global_batch=5"):
        GlobalBatchSampler(37, 6, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=3"):
        GlobalBatchSampler(37, 5, seed=4).load_state_dict(state)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_global_batches_identical_at_any_world_size(world_size):
    reference = _take(GlobalBatchSampler(50, 8, seed=11), 12)
    # Each rank runs its own sampler; only its slice is used.
    per_rank = [[rank_slice(b, r, world_size) for b in _take(GlobalBatchSampler(50, 8, seed=11), 12)]
                for r in range(world_size)]
    for step, batch in enumerate(reference):
        parts = [per_rank[r][step] for r in range(world_size)]
        assert all(len(p) == 8 // world_size for p in parts)
        assert sum(parts, []) == batch  # contiguous, disjoint, in rank order
    assert GlobalBatchSampler.rank_slice(reference[0], 1, 2) == reference[0][4:]


def test_bad_arguments():
    with pytest.raises(ValueError, match="does not divide"):
        rank_slice(list(range(6)), 0, 4)
    with pytest.raises(ValueError, match="rank 2"):
        rank_slice(list(range(4)), 2, 2)
    with pytest.raises(ValueError, match="num_samples"):
        GlobalBatchSampler(0, 4, seed=0)
    with pytest.raises(ValueError, match="global_batch"):
        GlobalBatchSampler(4, 0, seed=0)


def test_collate_packed_rows():
    tokens = np.arange(100, 130, dtype=np.uint32)
    labels = np.where(np.arange(30) % 3 == 0, -100, np.arange(100, 130)).astype(np.int32)
    # rows: [seg 0..4 | seg 5..9], [seg 10..17 + 2 pad], [seg 20..29]
    ds = PackedDataset(tokens, np.array([0, 5, 10, 20]), np.array([5, 5, 8, 10]), np.array([0, 2, 3, 4]),
                       seq_len=10, pad_id=7, labels=labels)
    assert len(ds) == 3 and ds.num_tokens == 28
    sampler = GlobalBatchSampler(len(ds), global_batch=4, seed=0)
    indices = next(iter(sampler))
    batch = collate([ds[i] for i in indices])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(v.shape == (4, 10) and v.dtype == torch.int64 for v in batch.values())
    row1 = ds[1]
    assert row1["input_ids"].tolist() == list(range(110, 118)) + [7, 7]
    assert row1["labels"].tolist() == [-100 if k % 3 == 0 else 100 + k for k in range(10, 18)] + [-100, -100]
    assert row1["position_ids"].tolist() == list(range(8)) + [0, 1]
    assert ds[0]["position_ids"].tolist() == list(range(5)) * 2
    assert torch.equal(batch["input_ids"][0], ds[indices[0]]["input_ids"])
    with pytest.raises(ValueError, match="keys"):
        collate([ds[0], {"input_ids": ds[1]["input_ids"]}])
    with pytest.raises(ValueError, match="seq_len=10"):
        PackedDataset(tokens, np.array([0]), np.array([11]), np.array([0, 1]), seq_len=10, pad_id=0)
