"""AdamW in one Triton launch per parameter group: torch's AdamW, its state and checkpoints, streamed at
memory speed.

The step is memory-bound: per FP32 parameter it reads the parameter, its gradient and both moments and
writes the parameter and the moments (28 bytes). At the Qwen2.5-7B/22 shape on an H200 torch's fused AdamW
takes 1.24x that floor and, with the clip folded in as its `grad_scale`, also writes the scaled gradient back
(4 bytes more); `TritonAdamW` takes 1.10x and leaves the gradients as they are: the trainer's optimizer part
70.1 -> 56.9 ms, the BF16 step 2.0% faster, the FP8 one 2.7% (docs/benchmarks.md). It launches one kernel per
parameter group over all its tensors (a table of their addresses, 8,192 elements per program). What it
computes, per element, in FP32 with every operation rounded once (no fused multiply-add, a correctly rounded
division and square root), is `adamw_reference`; on a CPU the Triton interpreter runs
the same kernel and equals it bit for bit (tests/test_adamw.py). It is torch's AdamW up to the order of
rounding: the parameter decays first, m moves towards g as torch's `lerp`, v = beta2 v + (1 - beta2) g^2,
then p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).

State is torch's (`step` as a CPU tensor, `exp_avg`, `exp_avg_sq`), so a checkpoint moves freely between
this optimizer and torch's AdamW, fused or not. Gradient clipping folds in as with torch's fused AdamW: the
caller sets `optimizer.grad_scale` (a device tensor) for one step and every gradient is divided by it. So does
GradScaler's other hook: with `optimizer.found_inf` (a device tensor) not 0 the kernel writes nothing, so a
non-finite step is skipped without the host waiting for the norm. The host counts the step when it launches it
and takes the count back, if the flag was set, at the next `step` or `state_dict` (the flag's copy to the host
is long done by then).
The clip's norm comes from the same tables: `grad_norm` sums the squares of each program's chunk in one launch
per group (torch's `get_total_norm` took 1.57x its read floor at 7B/22 on the H200), and makes the step's
tables before the caller's host sync on the norm, so the step after it only launches.

A 2-D parameter may have an FP8 copy to keep (`write_fp8_blocks`: an FP8Linear's held weight,
`fp8train.hold_fp8_weights`). Such parameters are stepped by a second launch, one 128x128 block per program:
it steps the block as above, takes the amax of the updated values on the way, and writes the block's E4M3 data
and scale as `fp8train.fp8.kernels.quantize_blocks` would from the updated weight (the same helpers), re-reading
the block it has just written from L2. So the copy costs the optimizer 1 byte per element written, and no
forward or backward quantizes the weight from its 4 FP32 bytes again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    from ..fp8.kernels import abs_bits, inverse, scale_from_amax_bits, scaled
except ImportError:  # CPU-only installs: build_optimizer picks torch's AdamW there
    triton = None

__all__ = ["TritonAdamW", "adamw_reference", "read_later", "step_scalars", "triton_adamw_available"]

# (elements per loop iteration of a program, iterations per program, warps): 4 elements per thread, one 16-byte
# load a stream; 8,192 elements a program, so the tensor lookup is paid once per 32 KiB of each stream. The
# fastest of six shapes on an H100 (1.05x the copy floor) and within 1% of the fastest on an H200
# (benchmarks/optim_step.py, docs/benchmarks.md)
_LAUNCH = (1024, 8, 8)
_SIDE = 128  # a weight's FP8 scaling block is _SIDE x _SIDE (`write_fp8_blocks`)
# (rows of a block stepped a loop iteration, warps) of `write_fp8_blocks`' launch: 4 elements a thread a stream,
# as `_LAUNCH`, in programs of 1,024 threads (64 registers on SM90: two programs an SM). The fastest of five
# shapes on the H200, 1.25x its floor against (8, 8)'s 1.34x (benchmarks/optim_step.py, docs/benchmarks.md)
_BLOCKS_LAUNCH = (32, 32)


def _f32(x: float) -> float:
    """x rounded to FP32: the value the kernel receives for a Python float argument."""
    return torch.tensor(x, dtype=torch.float32).item()


def step_scalars(lr: float, weight_decay: float, betas: tuple[float, float], eps: float, step: int) -> dict:
    """The FP32 scalars of step `step` (1-based): made on the host in FP64 as torch's AdamW makes them, then
    rounded to FP32 once."""
    beta1, beta2 = betas
    return dict(decay=_f32(1 - lr * weight_decay), one_minus_beta1=_f32(1 - beta1), beta2=_f32(beta2),
                one_minus_beta2=_f32(1 - beta2), eps=_f32(eps), step_size=_f32(lr / (1 - beta1 ** step)),
                bc2_sqrt=_f32((1 - beta2 ** step) ** 0.5))


def adamw_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: dict,
                    grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step of FP32 `p` in place (and its moments `m`, `v`; `g` is not written), as `TritonAdamW`'s
    kernel computes it: each line one FP32 operation per element, rounded once."""
    s = scalars

    # Division and square root correctly rounded: evaluated in FP64 and rounded once to FP32 (exact, as FP64
    # carries more than 2 * 24 + 2 bits); torch's FP32 CPU kernels turn a division by a scalar into a multiply
    # by its reciprocal and take square roots within an ulp.
    def div(a, b):
        return (a.double() / (b.double() if torch.is_tensor(b) else b)).float()

    def sqrt(a):
        return a.double().sqrt().float()

    if grad_scale is not None:
        g = div(g, grad_scale)
    p.mul_(s["decay"])
    m.add_((g - m) * s["one_minus_beta1"])
    v.mul_(s["beta2"]).add_((g * g) * s["one_minus_beta2"])
    p.sub_(div(m, div(sqrt(v), s["bc2_sqrt"]) + s["eps"]) * s["step_size"])


if triton is not None:
    @triton.jit
    def _update(p, g, m, v, grad_scale, decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt,
                HAS_GRAD_SCALE: tl.constexpr):
        """One AdamW step of the values p, m, v with gradient g, as `adamw_reference` (each operation rounded once
        when launched without fp fusion): the new (p, m, v)."""
        if HAS_GRAD_SCALE:
            g = tl.div_rn(g, grad_scale)
        p = p * decay
        m = m + (g - m) * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        p = p - tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps) * step_size
        return p, m, v


    @triton.jit
    def _stream_pointers(row):
        """The FP32 pointers to p, g, m, v in a row of the address table (values read from it: not the kernel's
        own arguments)."""
        return (tl.load(row).to(tl.pointer_type(tl.float32)), tl.load(row + 1).to(tl.pointer_type(tl.float32)),
                tl.load(row + 2).to(tl.pointer_type(tl.float32)), tl.load(row + 3).to(tl.pointer_type(tl.float32)))


    @triton.jit
    def _tensor_scalars(hyper_ptr, grad_scale_ptr, t, HAS_GRAD_SCALE: tl.constexpr):
        """Tensor t's step size and sqrt(1 - beta2^step), and the clip's divisor (1.0, unused, without it)."""
        step_size = tl.load(hyper_ptr + 2 * t)
        bc2_sqrt = tl.load(hyper_ptr + 2 * t + 1)
        grad_scale = 1.0
        if HAS_GRAD_SCALE:
            grad_scale = tl.load(grad_scale_ptr)
        return step_size, bc2_sqrt, grad_scale


    @triton.jit
    def _adamw_kernel(addr_ptr, hyper_ptr, chunk_ptr, grad_scale_ptr, found_inf_ptr,
                      decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                      HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr,
                      ITERS: tl.constexpr):
        """Program c updates elements [j * BLOCK * ITERS, (j + 1) * BLOCK * ITERS) of tensor t, where
        (t, j) = chunk[c]; tensor t's row of the address table holds the addresses of p, g, m, v and its size,
        its row of `hyper` its step size and sqrt(1 - beta2^step). Nothing is stored where found_inf != 0."""
        c = tl.program_id(0)
        t = tl.load(chunk_ptr + 2 * c)
        j = tl.load(chunk_ptr + 2 * c + 1).to(tl.int64)
        row = addr_ptr + 5 * t
        p_ptr, g_ptr, m_ptr, v_ptr = _stream_pointers(row)
        n = tl.load(row + 4)
        step_size, bc2_sqrt, grad_scale = _tensor_scalars(hyper_ptr, grad_scale_ptr, t, HAS_GRAD_SCALE)
        if HAS_FOUND_INF:  # a skipped step: every load and store masked off, so nothing is read or written
            n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
        start = j * (BLOCK * ITERS)
        for i in tl.range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            p = tl.load(p_ptr + offs, mask=mask)
            g = tl.load(g_ptr + offs, mask=mask)
            m = tl.load(m_ptr + offs, mask=mask)
            v = tl.load(v_ptr + offs, mask=mask)
            p, m, v = _update(p, g, m, v, grad_scale, decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
                              bc2_sqrt, HAS_GRAD_SCALE)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)


    @triton.jit
    def _adamw_blocks_kernel(addr_ptr, hyper_ptr, block_ptr, fp8_ptr, grad_scale_ptr, found_inf_ptr,
                             decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                             HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, POW2: tl.constexpr,
                             FP32_DATA: tl.constexpr, SIDE: tl.constexpr, ROWS: tl.constexpr):
        """Program c steps block (bn, bk) (SIDE x SIDE) of the 2-D parameter t, (t, bn, bk) = block[c], as
        `_adamw_kernel` steps each element, then writes that block of the parameter's FP8 operand as
        `quantize_blocks` makes it from the updated values (E4M3 data, one scale). Tensor t's row of `fp8` holds
        the data's and the scales' addresses, the parameter's rows and columns, and the rows' lengths of the
        data and of the scales (the data's columns past the parameter's, if any, are zeros with their blocks'
        scale). Nothing is stored where found_inf != 0. `FP32_DATA`: the data is FP32, the values before the FP8
        cast (the CPU checks: Triton's interpreter casts to FP8 its own way)."""
        c = tl.program_id(0)
        t = tl.load(block_ptr + 3 * c)
        bn = tl.load(block_ptr + 3 * c + 1)
        bk = tl.load(block_ptr + 3 * c + 2)
        row = addr_ptr + 5 * t
        p_ptr, g_ptr, m_ptr, v_ptr = _stream_pointers(row)
        fp8 = fp8_ptr + 6 * t
        if FP32_DATA:
            q_ptr = tl.load(fp8).to(tl.pointer_type(tl.float32))
        else:
            q_ptr = tl.load(fp8).to(tl.pointer_type(tl.float8e4nv))
        s_ptr = tl.load(fp8 + 1).to(tl.pointer_type(tl.float32))
        n_rows = tl.load(fp8 + 2)
        n_cols = tl.load(fp8 + 3)
        ld_q = tl.load(fp8 + 4)
        ld_s = tl.load(fp8 + 5)
        step_size, bc2_sqrt, grad_scale = _tensor_scalars(hyper_ptr, grad_scale_ptr, t, HAS_GRAD_SCALE)
        if HAS_FOUND_INF:  # a skipped step: every load and store masked off
            n_rows = tl.where(tl.load(found_inf_ptr) == 0, n_rows, 0)
        # the block's first element: 64-bit offsets for it, 32-bit ones within the block
        first = (bn * SIDE).to(tl.int64) * n_cols + bk * SIDE
        p_ptr += first
        g_ptr += first
        m_ptr += first
        v_ptr += first
        q_ptr += (bn * SIDE).to(tl.int64) * ld_q + bk * SIDE
        n_cols = n_cols.to(tl.int32)
        row_end = (n_rows - bn * SIDE).to(tl.int32)  # rows of the block in the parameter (<= 0: none)
        col_end = n_cols - bk * SIDE
        q_end = ld_q.to(tl.int32) - bk * SIDE
        cols = tl.arange(0, SIDE)
        amax = tl.zeros([SIDE], dtype=tl.int32)  # per column, of |p| as FP32 bit patterns
        for i in tl.range(SIDE // ROWS):
            rows = i * ROWS + tl.arange(0, ROWS)
            mask = (rows < row_end)[:, None] & (cols < col_end)[None, :]
            offs = rows[:, None] * n_cols + cols[None, :]
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            p, m, v = _update(p, g, m, v, grad_scale, decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
                              bc2_sqrt, HAS_GRAD_SCALE)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
            amax = tl.maximum(amax, tl.max(tl.where(mask, abs_bits(p, False), 0), axis=0))
        s = scale_from_amax_bits(tl.max(amax, axis=0), 448.0, POW2)
        inv = inverse(s, POW2)
        tl.debug_barrier()  # the block's new values, stored by every thread of the program, are read back
        for i in tl.range(SIDE // ROWS):
            rows = i * ROWS + tl.arange(0, ROWS)
            p = tl.load(p_ptr + rows[:, None] * n_cols + cols[None, :],
                        mask=(rows < row_end)[:, None] & (cols < col_end)[None, :], other=0.0)
            q = scaled(p, inv).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + rows[:, None] * ld_q.to(tl.int32) + cols[None, :], q,
                     mask=(rows < row_end)[:, None] & (cols < q_end)[None, :])
        if row_end > 0:
            tl.store(s_ptr + bn * ld_s + bk, s)


    @triton.jit
    def _sum_squares_kernel(addr_ptr, chunk_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """out[c] = the sum of squares, in FP32, of program c's chunk of gradient t (the address table's second
        column; its chunks as `_adamw_kernel`'s)."""
        c = tl.program_id(0)
        t = tl.load(chunk_ptr + 2 * c)
        j = tl.load(chunk_ptr + 2 * c + 1).to(tl.int64)
        g_ptr = tl.load(addr_ptr + 5 * t + 1).to(tl.pointer_type(tl.float32))
        n = tl.load(addr_ptr + 5 * t + 4)
        start = j * (BLOCK * ITERS)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + offs, mask=offs < n, other=0.0)
            acc += g * g
        tl.store(out_ptr + c, tl.sum(acc, axis=0))


def triton_adamw_available() -> bool:
    """Whether Triton is importable (the kernel runs on CUDA tensors, or anywhere under Triton's interpreter)."""
    return triton is not None


def _interpreted() -> bool:
    return triton is not None and not isinstance(_adamw_kernel, triton.runtime.JITFunction)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay; no amsgrad, maximize or capturable) with one Triton launch per
    parameter group. FP32 parameters and gradients on CUDA (FSDP2 shards included: each rank steps its own).
    `optimizer.grad_scale`, a one-element device tensor set for one step, divides every gradient (the clip);
    `optimizer.found_inf`, likewise, skips the step where it is not 0."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, launch: tuple[int, int, int] = _LAUNCH,
                 blocks_launch: tuple[int, int] = _BLOCKS_LAUNCH):
        if triton is None:
            raise RuntimeError("TritonAdamW needs Triton (it ships with torch's CUDA builds)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32 or not (p.is_cuda or _interpreted()):
                    raise ValueError(f"TritonAdamW steps FP32 CUDA parameters, got {p.dtype} on {p.device}")
        self._launch = launch  # (block, iterations, warps); benchmarks/optim_step.py compares a few
        self._blocks_launch = blocks_launch  # (rows an iteration, warps); likewise
        self._chunk_maps: dict[tuple, torch.Tensor] = {}
        self._block_maps: dict[tuple, torch.Tensor] = {}
        self._fp8: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}  # write_fp8_blocks' copies
        self._fp8_kind: tuple[bool, torch.dtype] | None = None  # (pow2, data dtype) of every copy
        self._pending: list[_Table] | None = None  # grad_norm()'s tables, for the step() that follows
        self._unsettled: _Launched | None = None  # the last step launched with a found_inf flag

    def write_fp8_blocks(self, param: torch.Tensor, data: torch.Tensor | None, scale: torch.Tensor | None, *,
                         pow2: bool) -> None:
        """From the next step on, each step of `param` (2-D, [N, K]) also writes its FP8 operand, in place, as
        `fp8train.fp8.kernels.quantize_blocks` makes it from the updated values: E4M3 `data` [N, Kp] (Kp >= K;
        columns past K zeros) and row-major FP32 `scale` [ceil(N / 128), ceil(Kp / 128)], power-of-two scales
        with `pow2`. One launch per parameter group steps these parameters a 128x128 block per program and
        quantizes each block as it is written (an FP8Linear's held copy: `fp8train.hold_fp8_weights`). FP32
        `data` receives the values before the FP8 cast (checks). `data=None` stops it."""
        self._pending = None  # the tables say which parameters have copies
        if data is None:
            self._fp8.pop(param, None)
            return
        if not any(param is p for group in self.param_groups for p in group["params"]):
            raise ValueError("TritonAdamW.write_fp8_blocks: the parameter is not one this optimizer steps; its copy "
                             "would never be written")
        if scale is None:
            raise ValueError("TritonAdamW.write_fp8_blocks: data without its scales")
        n, k = param.shape if param.dim() == 2 else (0, 0)
        if param.dim() != 2 or hasattr(param, "to_local") or not param.is_contiguous():
            raise ValueError("TritonAdamW.write_fp8_blocks: the parameter must be a whole contiguous 2-D tensor (not "
                             f"an FSDP shard), got shape {tuple(param.shape)}")
        kp = data.shape[1] if data.dim() == 2 else 0
        want = (-(-n // _SIDE), -(-kp // _SIDE))
        if (data.dtype not in (torch.float8_e4m3fn, torch.float32) or data.shape[0] != n or kp < k
                or tuple(scale.shape) != want
                or scale.dtype != torch.float32 or not (data.is_contiguous() and scale.is_contiguous())
                or data.device != param.device or scale.device != param.device):
            raise ValueError(f"TritonAdamW.write_fp8_blocks: for a [{n}, {k}] parameter the copy must be contiguous "
                             f"E4M3 data [{n}, >= {k}] and FP32 scales [{want[0]}, ceil(columns / 128)] on its device, "
                             f"got {data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}")
        kind = (bool(pow2), data.dtype)
        if self._fp8 and kind != self._fp8_kind:
            raise ValueError("TritonAdamW.write_fp8_blocks: the copies of one optimizer share their scales' kind and "
                             f"data type ({self._fp8_kind}, got {kind})")
        self._fp8[param] = (data, scale)
        self._fp8_kind = kind

    def _chunk_map(self, sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """[chunks, 2] int32: (tensor, chunk within it) for each program; depends only on the sizes (a size 0:
        no chunks, for a tensor another kernel steps)."""
        key = (sizes, device)
        if key not in self._chunk_maps:
            block, iters, _ = self._launch
            counts = torch.tensor([-(-n // (block * iters)) for n in sizes])
            tensor = torch.repeat_interleave(torch.arange(len(sizes)), counts)
            first = torch.cumsum(counts, 0) - counts
            within = torch.arange(len(tensor)) - first[tensor]
            self._chunk_maps[key] = torch.stack([tensor, within], 1).to(torch.int32).to(device)
        return self._chunk_maps[key]

    def _block_map(self, grids: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
        """[blocks, 3] int32: (tensor, block row, block column) for each program of `_adamw_blocks_kernel`, from
        (tensor, block rows, block columns) of each tensor with an FP8 copy."""
        key = (grids, device)
        if key not in self._block_maps:
            parts = [torch.stack([torch.full((r * c,), t), torch.arange(r).repeat_interleave(c),
                                  torch.arange(c).repeat(r)], 1) for t, r, c in grids]
            self._block_maps[key] = torch.cat(parts).to(torch.int32).to(device)
        return self._block_maps[key]

    def _tables(self) -> list["_Table"]:
        """Per group with gradients: its parameters, their gradients, the device table of (p, g, m, v) addresses
        and sizes, and the chunk map. Made once a step (the moments created where missing): by `grad_norm`, whose
        tables `step` takes over while every gradient is the one they were made for."""
        pending = self._pending
        if pending is not None and len(pending) == sum(any(p.grad is not None for p in g["params"])
                                                       for g in self.param_groups) and all(map(_current, pending)):
            return pending
        tables = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
                raise ValueError("TritonAdamW: amsgrad, maximize, capturable and differentiable are not supported")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            rows, fp8_rows, grids = [], [], []
            for i, p in enumerate(params):
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":  # loaded from a fused or capturable AdamW's checkpoint
                    state["step"] = state["step"].cpu()
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
                    raise ValueError("TritonAdamW steps contiguous FP32 parameters, gradients and moments; got "
                                     f"{[(t.dtype, t.is_contiguous()) for t in tensors]}")
                rows.append([t.data_ptr() for t in tensors] + [tensors[0].numel()])
                copy = self._fp8.get(p)
                if copy is None:
                    fp8_rows.append([0] * 6)
                    continue
                (data, scale), (n, k) = copy, p.shape
                fp8_rows.append([data.data_ptr(), scale.data_ptr(), n, k, data.shape[1], scale.shape[1]])
                grids.append((i, *scale.shape))
            device = _local(params[0]).device
            chunks = self._chunk_map(tuple(r[4] for r in rows), device)
            addr = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
            flat, blocks, fp8 = chunks, None, None
            if grids:  # the tensors with copies are stepped by blocks, the rest by chunks
                blocked = {i for i, _, _ in grids}
                flat = self._chunk_map(tuple(0 if i in blocked else r[4] for i, r in enumerate(rows)), device)
                blocks = self._block_map(tuple(grids), device)
                fp8 = torch.tensor(fp8_rows, dtype=torch.int64).to(device, non_blocking=True)
            tables.append(_Table(group, params, [weakref.ref(p.grad) for p in params], addr, chunks, flat, blocks, fp8))
        return tables

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of every gradient this optimizer steps, as a 0-d FP32 device tensor (no host sync): one
        launch per group sums the squares of each 8,192-element chunk in FP32, and the chunks' sums are added in
        FP64 (FSDP2: this rank's shards, then all-reduced across the mesh). Made from the address tables the
        next `step` uses, so their host work is done here, before the caller reads the norm."""
        self._pending = tables = self._tables()
        sums = []
        for t in tables:
            partial = torch.empty(t.chunks.shape[0], dtype=torch.float32, device=t.addr.device)
            if partial.numel():
                _sum_squares_kernel[(partial.numel(),)](t.addr, t.chunks, partial, BLOCK=self._launch[0],
                                                        ITERS=self._launch[1], num_warps=self._launch[2])
            sums.append(partial.double().sum())
        if not sums:
            return torch.zeros((), dtype=torch.float32)
        total = torch.stack(sums).sum()
        mesh = getattr(tables[0].params[0].grad, "device_mesh", None)
        if mesh is not None:  # FSDP2 DTensor gradients: the shards' sums of squares add up across ranks
            torch.distributed.all_reduce(total, group=mesh.get_group())
        return total.sqrt().float()

    def load_state_dict(self, state_dict) -> None:
        self._pending = None  # the tables hold the addresses of the moments this replaces
        self._unsettled = None  # the counts it would correct are replaced too
        super().load_state_dict(state_dict)

    def state_dict(self) -> dict:
        self._settle()
        return super().state_dict()

    def _settle(self) -> None:
        """Take back the step counts of the last step if its `found_inf` skipped it on the device."""
        launched, self._unsettled = self._unsettled, None
        if launched is None:
            return
        if launched.flag().item() != 0:
            torch._foreach_sub_(launched.steps, 1)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW.step takes no closure")
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self._settle()  # the previous step's counts, before this one's bias corrections are made from them
        tables, self._pending = self._tables(), None
        counted = []
        for t in tables:
            if t.chunks.numel() == 0 and t.blocks is None:
                continue
            steps = [self.state[p]["step"] for p in t.params]
            torch._foreach_add_(steps, 1)
            counted += steps
            group = t.group
            lr, wd, betas, eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
            # one host read of the group's steps (they agree, except after loading parameters one by one)
            counts = [int(c) for c in torch.stack(steps).tolist()]
            by_step = {c: step_scalars(lr, wd, betas, eps, c) for c in set(counts)}
            per_tensor = [[by_step[c]["step_size"], by_step[c]["bc2_sqrt"]] for c in counts]
            s = by_step[counts[0]]  # (decay, betas, eps: the same for every step)
            hyper = torch.tensor(per_tensor, dtype=torch.float32).to(t.addr.device, non_blocking=True)
            scale = grad_scale.float().reshape(1) if grad_scale is not None else None  # None: compiled out
            flag = found_inf.float().reshape(1) if found_inf is not None else None
            common = dict(HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                          enable_fp_fusion=False)
            scalars = (s["decay"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"], s["eps"])
            if t.flat.numel():
                _adamw_kernel[(t.flat.shape[0],)](t.addr, hyper, t.flat, scale, flag, *scalars, BLOCK=self._launch[0],
                                                  ITERS=self._launch[1], num_warps=self._launch[2], **common)
            if t.blocks is not None:
                _adamw_blocks_kernel[(t.blocks.shape[0],)](t.addr, hyper, t.blocks, t.fp8, scale, flag, *scalars,
                                                           POW2=self._fp8_kind[0],
                                                           FP32_DATA=self._fp8_kind[1] == torch.float32, SIDE=_SIDE,
                                                           ROWS=self._blocks_launch[0],
                                                           num_warps=self._blocks_launch[1], **common)
        if found_inf is not None and counted:
            self._unsettled = _Launched(read_later(found_inf.reshape(())), counted)
        return None


def _current(table: "_Table") -> bool:
    """Whether the group's parameters with gradients, and those gradients, are still the ones `table` was made of."""
    live = [p for p in table.group["params"] if p.grad is not None]
    return len(live) == len(table.params) and all(
        p is q and p.grad is g() for p, q, g in zip(live, table.params, table.grads))


class _Table(NamedTuple):
    """One parameter group's launch data for a step (`TritonAdamW._tables`)."""

    group: dict
    params: list[torch.Tensor]
    grads: list[weakref.ref]  # the gradients the addresses are of (weak: a skipped step must not keep them)
    addr: torch.Tensor    # [tensors, 5] int64 on the device: addresses of p, g, m, v (this rank's), numel
    chunks: torch.Tensor  # [programs, 2] int32: (tensor, chunk within it), every tensor (the gradient norm's)
    flat: torch.Tensor    # the chunks of the tensors without an FP8 copy (`_adamw_kernel`'s)
    blocks: torch.Tensor | None  # [programs, 3] int32: (tensor, block row, block column) of those with one
    fp8: torch.Tensor | None     # [tensors, 6] int64: their copies' addresses and shapes (`_adamw_blocks_kernel`)



class _Launched(NamedTuple):
    """A step launched with a `found_inf` flag: a reader of the flag, and the step counts it incremented."""

    flag: Callable[[], torch.Tensor]
    steps: list[torch.Tensor]


def read_later(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start copying `t` to the host without waiting for the device; the function returned waits for that copy
    only (not for the work queued after it) and returns the host tensor. On the CPU: a copy, at once."""
    if t.device.type != "cuda":
        host = t.detach().clone()
        return lambda: host
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> torch.Tensor:
        done.synchronize()
        return host

    return read
