"""FP8 parameter all-gather for FSDP2 (the paper's `--fp8-param-gather`).

FSDP2 all-gathers each parameter through two hooks on the sharded parameter's local tensor
(`fsdp_pre_all_gather` / `fsdp_post_all_gather`, see torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
Here the local tensor of a converted Linear's FP32 master weight is an `_Fp8ShardedWeight`:

    pre-all-gather   quantize the FP32 shard [N/W, K] in 128x128 blocks -> (E4M3 data, FP32 scales)
    all-gather       N*K bytes of data + 4 bytes per 128x128 block, instead of 2*N*K bytes of BF16
    post-all-gather  an `_Fp8GatheredWeight` [N, K] holding the gathered data and scales

FP8Linear asks the gathered weight for its GEMM operand (`fp8_operand`) instead of quantizing, so
the forward uses exactly the gathered blocks (and the backward their transpose). Because FSDP shards dim 0 and every shard starts on a
128-row boundary (N divisible by 128 x world size), each rank's blocks are blocks of the full weight:
the gathered FP8 weight equals, bit for bit, the single-process quantization of the FP32 master. The
gathered weight reports the BF16 param dtype, so its gradient is BF16 like every other parameter's and
FSDP reduce-scatters it in FP32 into the FP32 master shard's gradient, as on the BF16-gather path.

Everything except the all-gather sees `_Fp8ShardedWeight` as its FP32 tensor (optimizer, state dicts,
checkpoints); torchao's float8 FSDP weight wrapper (torchao/float8/fsdp_utils.py) is the model for it.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn

from .operands import OperandSpec, pad_operand
from .quant import Fp8Tensor, dequantize, quantize_2d
from .recipe import BLOCK, Fp8Format, Fp8Recipe

__all__ = ["fp8_gather_blocker", "fp8_gathered_parameter", "unwrap"]

_aten = torch.ops.aten

# Ops whose results stay `_Fp8ShardedWeight`: the ones FSDP uses to pad, view and copy the local shard.
_PRESERVE = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.clone.default,
}


def fp8_gather_blocker(module: nn.Module, world_size: int) -> str | None:
    """Why `module`'s weight cannot be all-gathered in FP8 at `world_size`, or None when it can."""
    from .linear import FP8Linear

    if not isinstance(module, FP8Linear) or not module.recipe.enabled:
        return "not an FP8 Linear"
    if world_size == 1:  # FSDP2 then copies the shard instead of gathering it, and takes only one input
        return "world size 1: nothing to all-gather"
    r = module.recipe
    if r.output.b.block != BLOCK or r.output.b.fmt is None or r.grad_input.b != r.output.b:
        return f"recipe {r.name.value!r} has no 128x128 weight blocks"
    n = module.out_features
    if n % (128 * world_size):
        return f"out_features {n} is not a multiple of 128 x world size {world_size} (shards not block-aligned)"
    return None


def fp8_gathered_parameter(weight: nn.Parameter, recipe: Fp8Recipe) -> nn.Parameter:
    """`weight` as a Parameter whose data FSDP2 all-gathers in FP8 blocks (before `fully_shard`)."""
    shard = _Fp8ShardedWeight(weight.data, recipe.output.b.fmt, recipe.pow2_scale)
    return nn.Parameter(shard, requires_grad=weight.requires_grad)


def unwrap(value):
    """`value` with every `_Fp8ShardedWeight` (also inside DTensors) replaced by its plain FP32 tensor.

    The result aliases the same storage, so in-place loads into it load into the model."""
    from torch.distributed.tensor import DTensor

    def plain(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, _Fp8ShardedWeight):
            return t._tensor
        if isinstance(t, DTensor) and isinstance(t._local_tensor, _Fp8ShardedWeight):
            return DTensor.from_local(t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return t

    return pytree.tree_map_only(torch.Tensor, plain, value)


class _Fp8ShardedWeight(torch.Tensor):
    """An FP32 (master) weight shard that FSDP2 all-gathers as 128x128-block FP8 data + scales."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, fmt: Fp8Format, pow2_scale: bool):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, fmt: Fp8Format, pow2_scale: bool):
        self._tensor = tensor
        self._fmt = fmt
        self._pow2 = pow2_scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        meta = None

        def plain(t):
            nonlocal meta
            meta = (t._fmt, t._pow2)
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, plain, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, *meta), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._fmt, self._pow2)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _Fp8ShardedWeight(inner["_tensor"], *meta)

    def __repr__(self) -> str:
        return f"_Fp8ShardedWeight({self._tensor!r}, fmt={self._fmt.value})"

    # The 5-argument form is what torch >= 2.6 calls (2.11 and 2.13 alike); FSDP counts the parameters,
    # and the defaults keep the 1-argument (mesh only) call of older releases working too.
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        if self._tensor.shape[0] % 128:
            raise RuntimeError(f"FP8 all-gather needs 128-row shards, got a shard of shape {tuple(self._tensor.shape)}")
        # No cache across gathers: updates reach the shard below this wrapper (optimizer ops on the DTensor's
        # local tensor, DCP loads into aliases), where no version counter moves.
        return quantize_2d(self._tensor.detach(), BLOCK, self._fmt, self._pow2), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        data, scale = all_gather_outputs
        if out is not None:  # later gathers land in the same (re-allocated) buffers as the first
            if not (isinstance(out, _Fp8GatheredWeight) and out._data.data_ptr() == data.data_ptr()
                    and out._scale.data_ptr() == scale.data_ptr()):
                raise RuntimeError("FP8 all-gather: FSDP gave an unsharded weight that does not alias its buffers")
            return None
        return _Fp8GatheredWeight(data, scale, param_dtype, self._fmt, self._pow2), (data, scale)


class _Fp8GatheredWeight(torch.Tensor):
    """The unsharded weight after an FP8 all-gather: data [N, K] in FP8 and one FP32 scale per 128x128
    block. Its dtype is the param dtype (BF16), the dtype of the gradient it receives. FP8Linear reads
    `fp8_operands`; any other op sees the dequantized weight."""

    @staticmethod
    def __new__(cls, data, scale, dtype, fmt, pow2_scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype, fmt: Fp8Format, pow2_scale: bool):
        self._data, self._scale, self._fmt, self._pow2 = data, scale, fmt, pow2_scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default) or (
                func is _aten.as_strided.default and tuple(args[1]) == tuple(args[0].shape)):
            w = args[0]  # FSDP views the unsharded tensor as its own shape; nn.Parameter detaches it
            return cls(w._data, w._scale, w.dtype, w._fmt, w._pow2)
        if func._schema.is_mutable:
            raise RuntimeError(f"{func} would modify an FP8 all-gathered weight; it is read-only (update the "
                               "sharded FP32 master instead)")
        args, kwargs = pytree.tree_map_only(cls, lambda w: w.dequantize_to_param_dtype(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._fmt, self._pow2)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _Fp8GatheredWeight(inner["_data"], inner["_scale"], *meta)

    def __repr__(self) -> str:
        return f"_Fp8GatheredWeight(shape={tuple(self.shape)}, fmt={self._fmt.value}, dtype={self.dtype})"

    def dequantize_to_param_dtype(self) -> torch.Tensor:
        return dequantize(Fp8Tensor(self._data, self._scale, BLOCK, self._fmt)).to(self.dtype)

    def fp8_operand(self, spec: OperandSpec, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """W's operand for the output GEMM, from the gathered blocks as they are, padded for it."""
        if spec.block != BLOCK or spec.fmt != self._fmt or pow2 != self._pow2:
            raise RuntimeError(f"FP8 all-gathered weight ({self._fmt.value}, 128x128, pow2_scale={self._pow2}) does "
                               f"not match the layer's weight operand ({spec.key}, pow2_scale={pow2})")
        return pad_operand(self._data, self._scale, spec)
