"""Attention for rows packed from several documents: a block-sparse kernel instead of a dense mask.

CPT's `document_masking` and SFT's packing restart `position_ids` at every document of a row, and Hugging
Face's models then attend within each document only. With HF's SDPA that takes a dense [B, 1, S, S] mask built
every forward, which rules out SDPA's causal flash kernels and computes every masked-out score: at 8,192 tokens
attention costs ~3.5x a row of one document's (docs/benchmarks.md, twenty-second session).

`use_packed_attention(model)` gives the model one attention implementation, registered with transformers'
`AttentionInterface` and `AttentionMaskInterface` under `PACKED_ATTENTION`, that chooses by HF's own mask
arguments, so its semantics are HF's wherever the model is called:
  - a row of one document (HF may skip the mask: `allow_is_causal_skip`): SDPA with `is_causal`, exactly HF's
    `sdpa` path (the same mask, None, and the same function);
  - anything else (packed documents, padding): a flex-attention `BlockMask` built from HF's own mask function
    (same document and causal), and `flex_attention` over it, which skips every 128 x 128 block outside a
    document. Grouped-query heads are handed over as they are (`enable_gqa`), not repeated.
Only the attention kernel changes: which scores count is HF's mask function either way, so a packed row's
output equals SDPA-with-the-dense-mask up to the kernels' BF16 rounding (tests/test_attention.py,
tests/test_gpu.py). Checkpoints do not record it (HF does not save the implementation in config.json).

`document_mask` makes that same mask from the host's copy of a batch's `position_ids`, for the trainer to pass
as the model's `attention_mask` (a 4-D mask, which every HF model takes as it is). HF, left to build it, asks
the GPU in every forward whether the rows hold several documents (`find_packed_sequence_indices`), which makes
the host wait for the step before; the host knows already. Rows of one document get, under `PACKED_ATTENTION`,
one causal `BlockMask` (made once per length), which the attention above runs as HF's SDPA path with no mask
(`is_causal`); under plain `sdpa` they still go through HF's check, since None is its only causal mask.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..data.sampler import host_to_device

__all__ = ["PACKED_ATTENTION", "use_packed_attention", "document_mask"]

PACKED_ATTENTION = "fp8train_sdpa_flex"


def _mask(*args, **kwargs):
    """HF's mask for this implementation: None (causal SDPA) where HF's SDPA would skip the mask, else a
    `BlockMask` of HF's mask function."""
    from transformers.masking_utils import flex_attention_mask, sdpa_mask

    if args or kwargs.get("allow_is_causal_skip", True):
        return sdpa_mask(*args, **kwargs)  # None for a row of one document; a dense mask for padding
    return flex_attention_mask(**kwargs)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type == "cpu" or torch.compiler.is_compiling():
        return flex_attention(query, key, value, **kwargs)  # traced by the caller's compile (or the CPU's reference)
    return _compiled_flex()(query, key, value, **kwargs)  # eager on CUDA: flex only runs fast compiled


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """HF's attention interface: [B, H, S, D] query, key, value in; [B, S, H, D] out (and no weights)."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, BlockMask) and attention_mask.mask_mod is _causal:
        attention_mask = None  # `document_mask`'s causal BlockMask (rows of one document) stands for HF's None
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("packed-document attention (flex) has no dropout; set the model's attention_dropout to 0")
    out = _flex(query, key, value, block_mask=attention_mask, scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _causal(b, h, q, kv):
    return q >= kv


@functools.cache
def _causal_block_mask(s: int, device: torch.device):
    """The causal mask of rows of `s` tokens as a `BlockMask` (any batch size): `_attention` runs it as SDPA's
    `is_causal`, HF takes it as a prepared 4-D mask (no check of `position_ids`)."""
    return _block_mask(_causal, None, s, device)


def _same_document_causal(doc: torch.Tensor):
    """The mask function of rows whose document index per token is `doc` [B, S] (HF's packed-row mask)."""
    return lambda b, h, q, kv: (q >= kv) & (doc[b, q] == doc[b, kv])


def _block_mask(mask_mod, b: int | None, s: int, device: torch.device):
    """`mask_mod`'s `BlockMask` for rows of `s` tokens (b rows, or None: any), compiled on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask

    make = _compiled_block_mask() if device.type == "cuda" else create_block_mask
    return make(mask_mod, b, None, s, s, device=device)


@functools.cache
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)  # never materializes the [S, S] mask


def document_mask(config, position_ids: torch.Tensor, device: torch.device):
    """The attention mask that HF's model of `config` would build for a batch of rows, made from `position_ids`
    [B, S] on the host without waiting for the GPU: under `PACKED_ATTENTION` a `BlockMask` (rows of one
    document each: the causal one, which `_attention` runs as HF's SDPA path with no mask), else for packed rows
    HF's SDPA mask, dense [B, 1, S, S] booleans. None where HF builds the mask itself: rows of one document each
    under `sdpa`, attention other than `sdpa` or `PACKED_ATTENTION`, layers other than full attention (sliding
    windows).

    The documents are HF's own (`find_packed_sequence_indices`, on the host's copy: no GPU read).
    """
    from transformers.masking_utils import find_packed_sequence_indices

    if position_ids.device.type != "cpu":
        raise ValueError("document_mask: position_ids must be the host's copy (reading the GPU's would wait)")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", PACKED_ATTENTION) or \
            set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return None
    doc = find_packed_sequence_indices(position_ids)  # None: one document a row
    if doc is None:
        return _causal_block_mask(position_ids.shape[-1], device) if impl == PACKED_ATTENTION else None
    doc = host_to_device(doc, device)
    b, s = doc.shape
    if impl == PACKED_ATTENTION:
        return _block_mask(_same_document_causal(doc), b, s, device)
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _mask)


def use_packed_attention(model: nn.Module) -> None:
    """Give a Hugging Face model (PEFT-wrapped or not) the attention above, in place."""
    _register()
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf.set_attn_implementation(PACKED_ATTENTION)
