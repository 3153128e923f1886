"""The LM head and the causal-LM loss without [tokens, vocabulary] logits.

Hugging Face's CausalLM forward computes `logits = lm_head(hidden)` for every token and then
`ForCausalLMLoss`: the logits cast to FP32, labels shifted by one, cross-entropy summed over the targets
(-100 ignored) and divided by `num_items_in_batch`. At 8192 tokens x 151,936 entries that is 2.5 GB of
BF16 logits plus ~10 GB of FP32 copies and gradients. `use_loss(model, "chunked")` makes the model's own
forward call (so FSDP2's root hooks still gather lm_head/embeddings around it) compute the same loss
chunk by chunk of tokens instead, and returns `logits=None` when `labels` are given:

- per chunk of C tokens: the BF16 head GEMM, the FP32 cross-entropy and its gradient with respect to the
  chunk's logits, and at once the two gradient GEMMs (the chunk's hidden-state rows, and the head weight
  accumulated in FP32), all inside the forward, as Liger's fused linear cross-entropy does; backward
  only scales the stored gradients by the upstream gradient. Three head GEMMs, as in the plain path.
- memory: kept from forward to backward, the gradients (tokens x hidden in the hidden states' dtype,
  vocab x hidden in FP32) and, while the forward runs, the BF16 copies of the hidden states and the
  weight plus one chunk's logits and their gradient: about 16 bytes x C x vocab in eager mode
  (bf16 logits, fp32 copy, log-softmax, its gradient, bf16 gradient) and ~4 bytes x C x vocab compiled
  (estimates: benchmarks/lm_head_loss.py measures the peak), never tokens x vocab. C is `chunk_tokens`,
  by default enough tokens for 2**28 logits per chunk.
- numerics: each chunk runs Hugging Face's own ops (F.linear in BF16, `.float()`, `F.cross_entropy`
  summed, differentiated by autograd), so with a single chunk on the CPU the loss and both gradients
  are bit for bit those of the plain path; on a CPU without AVX-512, whose BF16 GEMM is a scalar loop 20-80x
  slower than FP32's, the head GEMMs run in FP32 on the BF16 values (the same products and rounding, sums in
  another order). With several chunks the weight gradient is the FP32 sum of
  per-chunk products (on CUDA accumulated by the GEMM in FP32, never rounded to BF16 as the plain path's
  is); compiled (`compile=True`), the per-chunk softmax/gradient arithmetic is inductor's.

- rows without a target: SFT's prompts and padding have no target (label -100), and their logits count for
  nothing. `target_rows(labels)`, made on the host from the batch's labels (the trainer passes it as
  `loss_rows`), names the rows that have one; the head then runs on those rows alone (both impls), and
  their gradient is scattered back (zeros elsewhere, as the plain path's). Where nearly every row has a
  target (CPT) it returns None and nothing is gathered.

`impl="liger"` uses Liger's fused linear cross-entropy (`liger-kernel`, Triton, CUDA only) instead;
`impl="hf"` restores the plain forward.
"""

from __future__ import annotations

import functools
import math
import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LOSS_IMPLS", "count_targets", "linear_cross_entropy", "target_rows", "use_loss"]

LOSS_IMPLS = ("chunked", "liger", "hf")
IGNORE_INDEX = -100
_CHUNK_LOGITS = 2**28  # logits per chunk by default: 1 GiB as FP32, ~1,700 tokens at a 151,936 vocabulary
_ROWS_MULTIPLE = 64  # rows kept by `target_rows`: a GEMM-friendly count


def _shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position i predicts labels[i + 1]; the last position of each row predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _has_target(labels: torch.Tensor) -> torch.Tensor:
    """Per position, whether its (shifted) label is a target: the one definition the count and the rows share."""
    return _shift_labels(labels) != IGNORE_INDEX


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """The number of targets in `labels` (unshifted, -100 ignored): the loss's `num_items_in_batch`."""
    return _has_target(labels).sum()


def target_rows(labels: torch.Tensor) -> torch.Tensor | None:
    """The rows of the flattened hidden states that the loss needs, for `linear_cross_entropy(rows=...)`: those
    whose (shifted) label is a target, in order, topped up with the first rows without one to a multiple of 64
    (a row without a target adds exactly nothing to the loss and gets a zero gradient either way). None where
    that would keep more than 7/8 of the rows (CPT: only each row's last position has no target), so CPT
    gathers nothing and computes what it did. Call it on the host, where the labels are made: its length is a
    shape, and reading it from the GPU would make the host wait."""
    has_target = _has_target(labels).reshape(-1)
    n, k = has_target.numel(), int(has_target.sum())
    keep = min(n, max(_ROWS_MULTIPLE, -(-k // _ROWS_MULTIPLE) * _ROWS_MULTIPLE))
    if keep * 8 > n * 7:
        return None
    if keep > k:
        has_target = has_target.clone()
        has_target[(~has_target).nonzero().squeeze(1)[:keep - k]] = True
    return has_target.nonzero().squeeze(1)


def _chunk_size(tokens: int, vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        return max(1, chunk_tokens)
    chunks = max(1, math.ceil(tokens * vocab / _CHUNK_LOGITS))
    per = math.ceil(tokens / chunks)
    return per if chunks == 1 else math.ceil(per / 128) * 128  # equal chunks, GEMM-friendly rows


# ----------------------------------------------------------------------------------- the head GEMMs


def _bf16_gemm_in_fp32(device: torch.device) -> bool:
    """Whether this device's BF16 GEMM is ATen's scalar fallback: a CPU without AVX-512 (oneDNN has no BF16
    kernel for it). There a [512, 151936] . [151936, 128] product took 40 s against 0.5 s in FP32 (an AVX2 EPYC,
    torch 2.13, one thread), so the head's GEMMs run in FP32 on the BF16 values instead: exact products, FP32
    accumulation and one rounding to BF16, as the BF16 GEMM computes, up to the order of the sums."""
    return device.type == "cpu" and not _cpu_has_avx512()


@functools.cache
def _cpu_has_avx512() -> bool:  # asked once: the head's GEMMs ask for every chunk
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of two BF16 matrices, as BF16 (`_bf16_gemm_in_fp32`: computed in FP32)."""
    if _bf16_gemm_in_fp32(a.device):
        return a.float().mm(b.float()).to(a.dtype)
    return a.mm(b)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) of BF16 x [tokens, hidden] and w [vocab, hidden] (the plain path's op), as `_mm`."""
    return _mm(x, w.t()) if _bf16_gemm_in_fp32(x.device) else F.linear(x, w)


# ------------------------------------------------------------------------------ one chunk's gradient


def _ce_grad_autograd(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor):
    """(cross-entropy sum, its gradient x `scale` w.r.t. the BF16 logits) by HF's ops and autograd."""
    with torch.enable_grad():
        logits = logits.detach().requires_grad_()
        ce = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
        (grad,) = torch.autograd.grad(ce, logits, grad_outputs=scale)
    return ce.detach(), grad


def _ce_grad_math(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor):
    """The same in plain tensor math, for torch.compile to fuse: (softmax - onehot) x scale, as BF16."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    valid = target != IGNORE_INDEX
    safe = torch.where(valid, target, 0).unsqueeze(-1)
    ce = torch.where(valid, (lse - z.gather(-1, safe)).squeeze(-1), 0.0).sum()
    onehot = torch.arange(z.shape[-1], device=z.device) == safe
    grad = (torch.exp(z - lse) - onehot.float()) * (scale * valid).unsqueeze(-1)
    return ce, grad.to(logits.dtype)


@functools.cache
def _compiled_ce_grad():
    return torch.compile(_ce_grad_math)


# ----------------------------------------------------------------------------------- the function


def _accumulate_grad_weight(acc: torch.Tensor | None, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc + grad.T @ x in FP32. On CUDA the GEMM accumulates in FP32 in place (no BF16 rounding, no
    temporary); elsewhere the chunk's product is the BF16 GEMM autograd would compute (so one chunk
    equals the plain path bit for bit), summed in FP32."""
    if grad.is_cuda:
        if acc is None:
            return torch.mm(grad.t(), x, out_dtype=torch.float32)
        return torch.addmm(acc, grad.t(), x, out_dtype=torch.float32, out=acc)
    product = _mm(grad.t(), x)
    return product.float() if acc is None else acc.add_(product)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = CE_sum(hidden @ weight.T, targets) / divisor, gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, divisor, chunk, ce_grad):
        with torch.autocast(hidden.device.type, enabled=False):
            x, w = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
            grad_x = torch.empty_like(hidden) if hidden.requires_grad else None
            grad_w, total = None, None
            for start in range(0, x.shape[0], chunk):
                xc = x[start:start + chunk]
                ce, grad = ce_grad(_linear(xc, w), targets[start:start + chunk], scale)
                total = ce if total is None else total + ce
                if grad_x is not None:
                    grad_x[start:start + chunk] = _mm(grad, w)
                if weight.requires_grad:
                    grad_w = _accumulate_grad_weight(grad_w, grad, xc)
                del grad
            if grad_w is not None:
                grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_x, grad_w)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_w = ctx.saved_tensors
        # The stored gradients are for an upstream gradient of 1; scaled in place (a second backward
        # through the same graph fails autograd's version check instead of scaling twice).
        if grad_x is not None:
            grad_x.mul_(grad_output)
        if grad_w is not None:
            grad_w.mul_(grad_output)
        return grad_x, grad_w, None, None, None, None, None


def _loss_only(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor, chunk: int) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        w = weight.to(torch.bfloat16)
        total = None
        for start in range(0, x.shape[0], chunk):
            logits = _linear(x[start:start + chunk].to(torch.bfloat16), w)
            ce = F.cross_entropy(logits.float(), targets[start:start + chunk], ignore_index=IGNORE_INDEX,
                                 reduction="sum")
            total = ce if total is None else total + ce
    return total / divisor


def _liger(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # FP32 inputs under the caller's autocast: Liger's GEMMs run in BF16 and its weight gradient
    # accumulates in FP32, as for our chunks.
    ce = liger_fused_linear_cross_entropy(x, weight, targets, ignore_index=IGNORE_INDEX, reduction="sum",
                                          accum_dtype=torch.float32)
    return ce / divisor


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_items_in_batch: torch.Tensor | int | None = None, *, impl: str = "chunked",
                         chunk_tokens: int | None = None, compile: bool = False,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
    """`ForCausalLMLoss(F.linear(hidden, weight), labels, num_items_in_batch=...)` without the logits.

    `hidden` [batch, seq, hidden] (or [tokens, hidden]) are the final hidden states, `weight` the head's
    [vocab, hidden] weight, `labels` the unshifted labels (shifted here; -100 ignored). The loss is the
    target cross-entropy sum divided by `num_items_in_batch`, or by this call's target count when None.
    `impl`: "chunked" (`chunk_tokens` tokens per chunk, None = 2**28 logits per chunk; `compile` runs
    the per-chunk softmax and gradient through torch.compile) or "liger". `rows` (`target_rows(labels)`):
    the head runs on those rows of the flattened tokens only; the others must have no target.
    """
    if impl not in ("chunked", "liger"):
        raise ValueError(f"linear_cross_entropy: impl must be 'chunked' or 'liger', got {impl!r}")
    x = hidden.reshape(-1, hidden.shape[-1])
    targets = _shift_labels(labels).reshape(-1).to(x.device)
    if x.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden states hold {x.shape[0]} tokens but labels {targets.shape[0]}")
    divisor = num_items_in_batch
    if divisor is None:
        divisor = (targets != IGNORE_INDEX).sum()  # (`_has_target` of the labels, already shifted above)
    elif torch.is_tensor(divisor):
        divisor = divisor.to(x.device)
    if rows is not None:  # (index_select's backward scatters the rows' gradient into zeros)
        rows = rows.to(x.device, non_blocking=True)
        x, targets = x.index_select(0, rows), targets.index_select(0, rows)
    if impl == "liger":
        return _liger(x, weight, targets, divisor)
    chunk = _chunk_size(x.shape[0], weight.shape[0], chunk_tokens)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return _loss_only(x, weight, targets, divisor, chunk)
    # d(loss)/d(CE sum), computed as autograd computes HF's `loss / num_items_in_batch` backward
    scale = torch.ones((), dtype=torch.float32, device=x.device) / divisor
    ce_grad = _compiled_ce_grad() if compile else _ce_grad_autograd
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, scale, divisor, chunk, ce_grad)


# ----------------------------------------------------------------------------- the model's forward


def _forward_with_loss(model: nn.Module, *args, labels=None, num_items_in_batch=None, logits_to_keep=0,
                       loss_rows=None, impl: str, chunk_tokens: int | None, compile: bool, **kwargs):
    hf_forward = type(model).forward  # the class's own (HF) forward; FSDP2 hooks wrap the call either way
    plain = not (isinstance(logits_to_keep, int) and logits_to_keep == 0) or "shift_labels" in kwargs
    if labels is None or plain:  # nothing to fuse, or what only the plain loss handles
        if num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        return hf_forward(model, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = model.get_decoder()(*args, **kwargs)
    head = model.get_output_embeddings()
    loss = linear_cross_entropy(outputs.last_hidden_state, head.weight, labels, num_items_in_batch, impl=impl,
                                chunk_tokens=chunk_tokens, compile=compile, rows=loss_rows)
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def use_loss(model: nn.Module, impl: str, *, chunk_tokens: int | None = None, compile: bool = False) -> bool:
    """Make `model(..., labels=...)` compute its loss with `impl` ("chunked", "liger" or "hf").

    The model's own forward call still runs the decoder (so FSDP2's root hooks, activation checkpointing
    and compiled layers are untouched); with labels it returns the loss and `logits=None`, and it takes
    `loss_rows=target_rows(labels)` (made on the host) to run the head on the rows with a target only.
    Without labels, or with `logits_to_keep` or `shift_labels`, the plain forward runs. Parameters,
    state_dict keys and the HF export do not change; "hf" restores the plain forward.
    Returns whether the model's forward now takes `loss_rows` (False for "hf": HF's forward does not).
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"config key 'train.loss_impl' must be one of {list(LOSS_IMPLS)}, got {impl!r}")
    model.__dict__.pop("forward", None)
    if impl == "hf":
        return False
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if (type(head) is not nn.Linear or head.bias is not None or not hasattr(model, "get_decoder")
            or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None)):
        raise ValueError(f"config key 'train.loss_impl' = {impl!r} needs a causal LM whose head is a plain "
                         f"bias-free nn.Linear on the decoder's output (got {type(head).__name__}); use 'hf'")
    if impl == "liger":
        try:
            import liger_kernel.transformers.functional  # noqa: F401
        except ImportError as e:
            raise ValueError(f"config key 'train.loss_impl' is 'liger' but liger-kernel is not importable "
                             f"({e}); pip install 'fp8train[liger]' on a CUDA machine, or use 'chunked'") from e
    forward = functools.partial(_forward_with_loss, impl=impl, chunk_tokens=chunk_tokens, compile=compile)
    # A method bound to the instance: deepcopy rebinds it to the copy; nothing global is patched.
    model.forward = types.MethodType(forward, model)
    return True
