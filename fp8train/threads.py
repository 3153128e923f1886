"""The CPU thread count of `train`, `eval` and `demo`: one torch thread on a CPU unless told otherwise.

torch starts one OpenMP thread per physical core, and its threads spin-wait between parallel regions.
For the small models a CPU trains and samples, a second thread gains little, and on a machine whose
cores are busy with anything else the spinning threads wait for each other. Measured on a shared 2-core
VM (load average about 7), one thread against torch's default of two: `fp8train eval` of the tiny SFT
model on 16 GSM8K problems, 29 s against 78 s; SFT of configs/tiny_sft.yaml, 225 against 92 tokens/s;
`fp8train demo`, 1m58s against 4m36s (issue 17 saw eval 6.6x slower). Commands that own their process
therefore pick one thread on a CPU (`cpu_threads` in a training config, `--threads` for eval and demo;
0 = torch's default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["cpu_threads"]


@contextlib.contextmanager
def cpu_threads(count: int | None) -> Iterator[None]:
    """Run the block with `count` intra-op torch threads and restore the previous count afterwards;
    None or 0 leaves torch's setting alone (one thread per physical core by default)."""
    before = torch.get_num_threads()
    if count:
        if count < 0:
            raise ValueError(f"the CPU thread count must be >= 0 (0 = torch's default), got {count}")
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
