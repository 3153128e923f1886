"""The order of training samples: one global batch of indices per optimizer step, at any world size."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["GlobalBatchSampler", "collate", "host_to_device", "rank_slice"]


class GlobalBatchSampler:
    """Yields the `global_batch` sample indices of each optimizer step, forever.

    The stream is a fresh seeded permutation of all samples per epoch, epochs concatenated, cut into
    global batches, so every step is full (a batch may straddle two epochs). Step `s` is a pure function
    of (seed, num_samples, global_batch, s): resuming needs only the step, and every rank of any world
    size sees the same global batches (each takes its `rank_slice`).
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if num_samples < 1:
            raise ValueError(f"GlobalBatchSampler: num_samples must be >= 1, got {num_samples}")
        if global_batch < 1:
            raise ValueError(f"GlobalBatchSampler: global_batch must be >= 1, got {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.step = 0
        """The step whose batch `__iter__` yields next."""
        self._perm: tuple[int, np.ndarray] | None = None  # the last epoch's order, reused by the next steps

    def _epoch(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return self._perm[1]

    def batch(self, step: int) -> list[int]:
        """The global batch of `step` (0-based), without moving the sampler."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        begin = step * self.global_batch
        end = begin + self.global_batch
        out: list[int] = []
        for epoch in range(begin // self.num_samples, (end - 1) // self.num_samples + 1):
            lo = max(begin, epoch * self.num_samples) - epoch * self.num_samples
            hi = min(end, (epoch + 1) * self.num_samples) - epoch * self.num_samples
            out.extend(self._epoch(epoch)[lo:hi].tolist())
        return out

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            indices = self.batch(self.step)
            self.step += 1  # a checkpoint taken while this batch trains resumes with the next one
            yield indices

    def state_dict(self) -> dict[str, int]:
        keys = ("step", "num_samples", "global_batch", "seed")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("num_samples", "global_batch", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"GlobalBatchSampler: checkpoint has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; resuming would replay a different order"
                )
        self.step = int(state["step"])

    @staticmethod
    def rank_slice(indices: list[int], rank: int, world_size: int) -> list[int]:
        """This rank's contiguous part of a global batch."""
        return rank_slice(indices, rank, world_size)


def rank_slice(indices: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous `len(indices) // world_size` indices of a global batch."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if len(indices) % world_size:
        raise ValueError(f"global batch of {len(indices)} does not divide among {world_size} ranks")
    per_rank = len(indices) // world_size
    return indices[rank * per_rank : (rank + 1) * per_rank]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows into a batch of [B, S] int64 tensors (`input_ids`, `labels`, `position_ids`)."""
    if not samples:
        raise ValueError("collate: no samples")
    keys = samples[0].keys()
    for k, s in enumerate(samples):
        if s.keys() != keys:
            raise ValueError(f"collate: sample {k} has keys {sorted(s)}, sample 0 has {sorted(keys)}")
    return {key: torch.stack([s[key] for s in samples]).long() for key in keys}


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the host) on `device`, without the host waiting for the device: to CUDA through pinned memory
    (torch keeps the pinned block until the copy is done), since a copy from pageable memory may wait for the
    work queued before it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
