"""The optimizer part of a training step on a GPU: gradient clipping and AdamW, against the memory bandwidth.

    PYTHONPATH=. python benchmarks/optim_step.py --model qwen2.5-7b:22

The trainer's own pieces (`fp8train.train.optim.clip_grad_norm`, `optimizer_step`, `build_optimizer`) over the
FP32 parameters of a preset, random values and gradients, no forward. Bytes per parameter: clipping reads
the gradient for the norm and reads and writes it to scale it (12); AdamW reads parameter, gradient and
both moments and writes parameter and moments (28); clip then step, the trainer's first optimizer part, is
both (40); `optimizer_step` with torch's fused AdamW reads the gradient for the norm and passes the clip to the
fused step as its `grad_scale`, which also writes the scaled gradient back (4 + 28 + 4 = 36); with
fp8train's Triton AdamW (`optim.impl: triton`, the default on CUDA) the step leaves the gradient as it is
(4 + 28 = 32), and the norm is the optimizer's own (`TritonAdamW.grad_norm`, one launch per group). The
Triton step is also timed at a few other launch shapes, and writing the decoder projections' FP8 copies as it
steps them (`hold_fp8_weights`: 1 byte more per projection parameter; that launch at a few shapes too), against what those copies replace: W and
W.T quantized from the FP32 weights (`quantize_blocks`, 5 bytes each per projection parameter). The floor is
those bytes at the bandwidth of a large device copy measured in the same run. Each timed call includes the
norm's host sync, as in the trainer.
"""

from __future__ import annotations

import argparse
import statistics

import torch


# launch shapes of the Triton step besides its default: (elements per iteration, iterations per program, warps)
_LAUNCHES = [(2048, 4, 8), (1024, 8, 4), (512, 16, 4), (4096, 2, 8), (1024, 2, 4)]
# ... and of its FP8-copy launch besides `_BLOCKS_LAUNCH`: (rows of a block an iteration, warps)
_BLOCKS_LAUNCHES = [(8, 8), (16, 16), (32, 16), (8, 4)]


def _ms(fn, reps: int = 5, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    from fp8train.fp8.convert import DECODER_PROJECTIONS
    from fp8train.fp8.kernels import quantize_blocks
    from fp8train.fp8.recipe import Fp8Format
    from fp8train.train.model import ModelConfig, build_model
    from fp8train.train.adamw import TritonAdamW
    from fp8train.train.optim import (OptimConfig, _param_groups, _total_norm, build_optimizer, clip_grad_norm,
                                      optimizer_step)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b:22", help="PRESET[:LAYERS]")
    args = p.parse_args(argv)
    name, _, layers = args.model.partition(":")
    with torch.device("meta"):
        model = build_model(ModelConfig(source=name, num_layers=int(layers) if layers else None))
    model.to_empty(device="cuda")
    n = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.data.normal_(0, 0.02)
        p.grad = torch.randn_like(p) * 1e-3

    src = torch.empty(2**30, device="cuda")  # 4 GiB
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / _ms(lambda: dst.copy_(src)) / 1e6
    del src, dst

    # Clipping stays active throughout: after the first call the norm is ~max_norm, and both the clip
    # (multiplying by min(1, ...)) and the folded step (dividing by max(1, ...)) still pass over every gradient.
    rows = [("clip_grad_norm (norm + scale)", _ms(lambda: clip_grad_norm(model, 1.0)), 12),
            ("gradient norm alone", _ms(lambda: _total_norm(list(model.parameters())).item()), 4)]
    for impl, launch in [("fused", None), ("foreach", None), ("triton", None)] + [("triton", lc) for lc in _LAUNCHES]:
        if launch is None:
            opt = build_optimizer(model, OptimConfig(lr=1e-5, impl=impl))
        else:
            opt = TritonAdamW(_param_groups(model, 0.1), lr=1e-5, betas=(0.9, 0.95), launch=launch)
        tag = f"{impl} {launch}" if launch else impl
        rows.append((f"AdamW {tag} step", _ms(opt.step), 28))
        if impl == "fused":
            def clip_then_step():
                clip_grad_norm(model, 1.0)
                opt.step()

            rows.append(("clip_grad_norm, then fused step (trainer, fifth session)", _ms(clip_then_step), 40))
            # torch's fused step writes the scaled gradient back: 4 more bytes
            rows.append(("optimizer_step: clip folded into the fused step (trainer before)",
                         _ms(lambda: optimizer_step(opt, model, 1.0)), 36))
        if impl == "triton" and launch is None:
            # its own norm: one launch per group over the step's address tables (sixteenth session)
            rows.append(("Triton grad_norm alone", _ms(lambda: opt.grad_norm().item()), 4))
            rows.append(("optimizer_step: clip folded into the Triton step (trainer now)",
                         _ms(lambda: optimizer_step(opt, model, 1.0)), 32))
            # the projections' FP8 copies written by the step (twenty-seventh session), against quantizing W and
            # W.T from FP32 in the forward and the backward, what a step without them does
            e4m3 = Fp8Format.E4M3
            projections = [p for name, p in model.named_parameters()
                           if p.dim() == 2 and name.split(".")[-2] in DECODER_PROJECTIONS]
            share = sum(p.numel() for p in projections) / n
            for w in projections:
                opt.write_fp8_blocks(w, *quantize_blocks(w.detach(), e4m3, True, 16), pow2=True)
            rows.append(("Triton step writing the projections' FP8 copies", _ms(opt.step), 28 + share))
            rows.append(("optimizer_step with them (hold_fp8_weights)", _ms(lambda: optimizer_step(opt, model, 1.0)),
                         32 + share))

            def quantize_w_and_w_t():
                for w in projections:
                    quantize_blocks(w.detach(), e4m3, True, 16)
                    quantize_blocks(w.detach(), e4m3, True, 16, transpose=True)

            rows.append(("W and W.T quantized from FP32 (what the copies replace)", _ms(quantize_w_and_w_t),
                         10 * share))
            for blocks_launch in _BLOCKS_LAUNCHES:
                opt = None  # the last one's moments freed before the next one's are made
                opt = TritonAdamW(_param_groups(model, 0.1), lr=1e-5, betas=(0.9, 0.95), blocks_launch=blocks_launch)
                for w in projections:
                    opt.write_fp8_blocks(w, *quantize_blocks(w.detach(), e4m3, True, 16), pow2=True)
                rows.append((f"Triton step writing the copies, blocks launch {blocks_launch}", _ms(opt.step),
                             28 + share))
        del opt
        torch.cuda.empty_cache()

    print(f"{args.model}: {n / 1e9:.2f}B FP32 parameters; device copy {copy_gbs:,.0f} GB/s "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print("| piece | ms | bytes/param | GB/s | floor ms | x floor |")
    print("|---|---|---|---|---|---|")
    for label, ms, bpp in rows:
        floor = n * bpp / copy_gbs / 1e6
        print(f"| {label} | {ms:.1f} | {bpp:.3g} | {n * bpp / ms / 1e6:,.0f} | {floor:.1f} | {ms / floor:.2f} |")
    before, now = (next(ms for label, ms, _ in rows if key in label) for key in ("trainer before", "trainer now"))
    print(f"\nthe trainer's optimizer part: {before:.1f} -> {now:.1f} ms ({before - now:+.1f} ms saved)")


if __name__ == "__main__":
    main()
