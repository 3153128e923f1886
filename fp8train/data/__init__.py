"""Training data: sources (files, `datasets`), tokenizers, the CPT token cache and packing, SFT chat formatting
and packing, batch order.

Every dataset yields rows of `seq_len` tokens as dicts of 1-D int64 tensors (`input_ids`, `labels` with
-100 = no loss, `position_ids`). Packed documents/samples restart `position_ids` at 0: a causal LM
called with these position ids, no attention mask and `use_cache=False` attends only within each one.
"""

from .cpt import CptDataConfig, PackedDataset, build_cpt_datasets
from .sampler import GlobalBatchSampler, collate, host_to_device, rank_slice
from .sft import SftDataConfig, SftStats, build_sft_datasets, read_sft_holdout
from .sources import HfDatasetConfig
from .tokenizer import CHATML_TEMPLATE, load_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "CptDataConfig",
    "GlobalBatchSampler",
    "HfDatasetConfig",
    "PackedDataset",
    "SftDataConfig",
    "SftStats",
    "build_cpt_datasets",
    "build_sft_datasets",
    "collate",
    "host_to_device",
    "load_tokenizer",
    "rank_slice",
    "read_sft_holdout",
]
