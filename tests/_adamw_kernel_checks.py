"""CPU checks of the Triton AdamW kernel, run by tests/test_adamw.py in a subprocess.

    TRITON_INTERPRET=1 python tests/_adamw_kernel_checks.py interpret  # TritonAdamW in Triton's interpreter
    TRITON_INTERPRET=1 python tests/_adamw_kernel_checks.py fsdp       # ... stepping FSDP2 shards (2 CPU ranks)
    python tests/_adamw_kernel_checks.py compile                       # SM90 machine code: registers, spills, FMAs

`interpret` steps `TritonAdamW` on CPU tensors (the interpreter runs the kernel there) and compares it, bit for
bit, with `adamw_reference`, and within FP32 rounding with torch's AdamW and an FP64 AdamW; `compile` builds
the kernel for SM90 as the launch does. Prints one JSON line.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import triton

from fp8train.train import adamw

_CHUNK = adamw._LAUNCH[0] * adamw._LAUNCH[1]
_SIZES = (1, 1000, _CHUNK + 7, 3 * _CHUNK, 20_000)  # ragged, one chunk plus a tail, several chunks
_HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(_SIZES):
        p = torch.randn(n, generator=g) * (0.02 if i % 2 else 1.0)
        p[: n // 10] *= 100.0  # a spread of magnitudes
        out.append(torch.nn.Parameter(p))
    return out


def _groups(params, wd=0.1):
    return [{"params": params[::2], "weight_decay": wd}, {"params": params[1::2], "weight_decay": 0.0}]


def _grads(params, step: int, skip: int | None = None):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        p.grad = None if i == skip else torch.randn(p.shape, generator=g) * 10.0 ** (i % 3 - 2)


def _bits(t):
    return t.detach().view(torch.int32)


def interpret() -> dict:
    failures = []
    params = _params(0)
    ref = [p.detach().clone() for p in params]
    ref_state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    f64 = [p.detach().double() for p in params]
    f64_state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in f64]
    opt = adamw.TritonAdamW(_groups(params), **_HP)
    torch_opt = torch.optim.AdamW(_groups(torch_params), **_HP, foreach=True)
    steps = {i: 0 for i in range(len(params))}
    worst_norm = 0.0
    for step in range(1, 6):
        skip = 3 if step == 2 else None  # a parameter without a gradient takes no step
        _grads(params, step, skip)
        _grads(torch_params, step, skip)
        scale = torch.tensor([2.5]) if step in (3, 4) else None  # the clip, folded
        if step in (2, 3, 4):  # the norm first, as optimizer_step does: step() takes over its tables
            norm = opt.grad_norm().item()
            want = torch.cat([p.grad.double().flatten() for p in params if p.grad is not None]).norm().item()
            worst_norm = max(worst_norm, abs(norm - want) / want)
        if step == 3:  # a gradient replaced after the norm: the step must read the new one
            params[1].grad = params[1].grad * 0.5
            torch_params[1].grad = torch_params[1].grad * 0.5
        if step == 5:
            opt.grad_norm()
        opt.grad_scale = scale
        opt.step()
        del opt.grad_scale
        if scale is not None:
            for p in torch_params:
                if p.grad is not None:
                    p.grad.div_(scale)
        torch_opt.step()
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            steps[i] += 1
            wd = 0.1 if i % 2 == 0 else 0.0
            s = adamw.step_scalars(_HP["lr"], wd, _HP["betas"], _HP["eps"], steps[i])
            adamw.adamw_reference(ref[i], p.grad, *ref_state[i], s, scale)
            g = p.grad.double() / (scale.double() if scale is not None else 1.0)
            m, v = f64_state[i]
            f64[i].mul_(1 - _HP["lr"] * wd)
            m.mul_(_HP["betas"][0]).add_(g, alpha=1 - _HP["betas"][0])
            v.mul_(_HP["betas"][1]).add_(g * g, alpha=1 - _HP["betas"][1])
            bc1, bc2 = 1 - _HP["betas"][0] ** steps[i], 1 - _HP["betas"][1] ** steps[i]
            f64[i].sub_(_HP["lr"] / bc1 * m / ((v / bc2).sqrt() + _HP["eps"]))
        for i, p in enumerate(params):
            st = opt.state[p]
            if not torch.equal(_bits(p), _bits(ref[i])) or not torch.equal(_bits(st["exp_avg"]), _bits(ref_state[i][0])) \
                    or not torch.equal(_bits(st["exp_avg_sq"]), _bits(ref_state[i][1])):
                failures.append(f"step {step} tensor {i} ({p.numel()}): not the reference's bits")
            if int(st["step"].item()) != steps[i]:
                failures.append(f"step {step} tensor {i}: state step {st['step'].item()} != {steps[i]}")
    # against torch's AdamW and FP64: within a few FP32 roundings of the update
    worst = {"vs torch": 0.0, "vs fp64": 0.0, "torch vs fp64": 0.0}
    for p, tp, p0, d in zip(params, torch_params, _params(0), f64):
        moved = (d - p0.double()).abs().max().item()
        worst["vs torch"] = max(worst["vs torch"], (p.double() - tp.double()).abs().max().item() / moved)
        worst["vs fp64"] = max(worst["vs fp64"], ((p.double() - d).abs() / (d.abs() * 2 ** -23 + 1e-3 * moved)).max().item())
        worst["torch vs fp64"] = max(worst["torch vs fp64"],
                                     ((tp.double() - d).abs() / (d.abs() * 2 ** -23 + 1e-3 * moved)).max().item())
    if worst["vs torch"] > 1e-4:
        failures.append(f"differs from torch's AdamW by {worst['vs torch']:.2e} of the update")
    if worst["vs fp64"] > 8:
        failures.append(f"differs from FP64 AdamW by {worst['vs fp64']:.1f} (units: ulp of p + 1e-3 of the update)")
    if worst_norm > 1e-6:
        failures.append(f"grad_norm differs from the FP64 norm by {worst_norm:.1e} (relative)")
    # a step skipped on the device (`found_inf` set, as optimizer_step_on_device sets it) writes nothing, and its
    # count is taken back by the next step (which is then the reference's next step) or by state_dict
    def snapshot():
        return [torch.cat([_bits(t) for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])])
                for p in params]

    def counts():  # state_dict() first: it settles a skipped step's counts
        opt.state_dict()
        return [int(opt.state[p]["step"]) for p in params]

    for skipped, followed_by in ((6, "step"), (8, "state_dict")):
        _grads(params, skipped)
        before, counted = snapshot(), [steps[i] for i in range(len(params))]
        opt.grad_scale, opt.found_inf = torch.tensor([2.0]), torch.ones(())
        opt.step()
        del opt.grad_scale, opt.found_inf
        if not all(map(torch.equal, before, snapshot())):
            failures.append(f"a step with found_inf set wrote parameters or moments (then {followed_by})")
        if followed_by == "step":
            _grads(params, skipped + 1)
            opt.found_inf = torch.zeros(())
            opt.step()
            del opt.found_inf
            for i, p in enumerate(params):
                steps[i] += 1
                wd = 0.1 if i % 2 == 0 else 0.0
                s = adamw.step_scalars(_HP["lr"], wd, _HP["betas"], _HP["eps"], steps[i])
                adamw.adamw_reference(ref[i], p.grad, *ref_state[i], s)
                if not torch.equal(_bits(p), _bits(ref[i])):
                    failures.append(f"tensor {i}: the step after a skipped one is not the reference's next")
            counted = [c + 1 for c in counted]
        if counts() != counted:
            failures.append(f"step counts {counts()} after a skipped step then {followed_by}, want {counted}")
    # a step skipped after the norm (non-finite) keeps no gradient alive: the tables hold them weakly
    _grads(params, 8)
    opt.grad_norm()
    held = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    if any(r() is not None for r in held):
        failures.append("grad_norm's tables keep the gradients of a skipped step alive")
    # a checkpoint moves both ways: ours -> torch's AdamW (the same keys) and ours -> ours (the same next step)
    state = copy.deepcopy(opt.state_dict())  # load_state_dict keeps the tensors it is given
    other = torch.optim.AdamW(_groups(torch_params), **_HP, foreach=True)
    other.load_state_dict(state)
    if sorted(other.state_dict()["state"][0]) != ["exp_avg", "exp_avg_sq", "step"]:
        failures.append(f"state keys {sorted(other.state_dict()['state'][0])}")
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    back = adamw.TritonAdamW(_groups(clones), **_HP)
    _grads(params, 9)
    for c, p in zip(clones, params):
        c.grad = p.grad.clone()
    back.grad_norm()  # tables made over fresh moments, which the load replaces: the step must not use them
    back.load_state_dict(state)
    opt.step()
    back.step()
    if not all(torch.equal(_bits(c), _bits(p)) for c, p in zip(clones, params)):
        failures.append("a state_dict round trip changed the next step")
    failures += _blocks_failures()
    return {"failures": failures, "worst": {**worst, "grad_norm": worst_norm}}


def _pre_conversion(w: torch.Tensor, pow2: bool, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's W operand of `w` [N, K] in 128x128 blocks, `cols` (>= K) columns: the FP32 values before
    the FP8 cast (x * RN(1 / scale); zeros past K) and the row-major scales."""
    from fp8train.fp8.quant import compute_scale, reciprocal
    from fp8train.fp8.recipe import Fp8Format

    n, k = w.shape
    nb, kb = -(-n // 128), -(-cols // 128)
    blocks = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
    scale = compute_scale(blocks.abs().amax(dim=(1, 3)), Fp8Format.E4M3, pow2)
    return (blocks * reciprocal(scale, pow2)[:, None, :, None]).reshape(nb * 128, kb * 128)[:n, :cols], scale


def _blocks_failures() -> list:
    """`write_fp8_blocks`: parameters with an FP8 copy are stepped a 128x128 block per program and the copy written
    from the updated values. Two groups (decay and none) mixing them with a flat parameter; ragged rows and
    columns, padded data columns; four steps, the clip folded in one, one skipped (found_inf: nothing written,
    the copy included), one after the gradient norm (its tables taken over): parameters and moments equal
    `adamw_reference`, the copies (FP32 data: the values before the FP8 cast, which the interpreter does its own
    way) and their scales the reference quantization of the updated weights, bit for bit, with power-of-two and
    exact scales, and with another launch shape (8 rows an iteration). A copy let go is no longer written; a copy of the wrong shape or a 1-D parameter is refused."""
    failures = []
    g = torch.Generator().manual_seed(7)
    for pow2, launch in ((True, adamw._BLOCKS_LAUNCH), (False, adamw._BLOCKS_LAUNCH), (True, (8, 8))):
        shapes = {"flat": (77,), "ragged": (300, 200), "whole": (256, 128), "wide": (130, 384)}
        params = {k: torch.nn.Parameter(torch.randn(v, generator=g) * torch.logspace(-3, 2, v[-1]))
                  for k, v in shapes.items()}
        data_cols = {"ragged": 256, "whole": 128, "wide": 384}
        copies = {k: (torch.zeros(shapes[k][0], c), torch.zeros(-(-shapes[k][0] // 128), -(-c // 128)))
                  for k, c in data_cols.items()}
        opt = adamw.TritonAdamW([{"params": [params["flat"], params["ragged"], params["whole"]], "weight_decay": 0.1},
                                 {"params": [params["wide"]], "weight_decay": 0.0}], **_HP,
                                blocks_launch=launch)
        for k, (data, scale) in copies.items():
            opt.write_fp8_blocks(params[k], data, scale, pow2=pow2)
        ref = {k: p.detach().clone() for k, p in params.items()}
        moments = {k: (torch.zeros_like(p), torch.zeros_like(p)) for k, p in ref.items()}
        counts = dict.fromkeys(params, 0)
        for step in range(1, 5):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g) * 0.1
            skip, scale = step == 3, (torch.tensor([2.5]) if step == 2 else None)
            if step == 4:
                opt.grad_norm()
            before = [t.clone() for d in copies.values() for t in d]
            opt.grad_scale, opt.found_inf = scale, torch.ones(()) if skip else torch.zeros(())
            opt.step()
            del opt.grad_scale, opt.found_inf
            if skip:
                if not all(torch.equal(a, b) for a, b in zip(before, (t for d in copies.values() for t in d))):
                    failures.append(f"pow2={pow2} {launch} step {step}: a skipped step wrote an FP8 copy")
                continue
            for k, p in params.items():
                counts[k] += 1
                wd = 0.0 if k == "wide" else 0.1
                adamw.adamw_reference(ref[k], p.grad, *moments[k], adamw.step_scalars(_HP["lr"], wd, _HP["betas"],
                                                                                    _HP["eps"], counts[k]), scale)
                if not (torch.equal(_bits(p), _bits(ref[k])) and torch.equal(_bits(opt.state[p]["exp_avg_sq"]),
                                                                             _bits(moments[k][1]))):
                    failures.append(f"pow2={pow2} {launch} step {step} {k}: not the reference's step")
                if k in copies:
                    want, want_scale = _pre_conversion(ref[k], pow2, data_cols[k])
                    if not (torch.equal(_bits(copies[k][0]), _bits(want)) and torch.equal(copies[k][1], want_scale)):
                        failures.append(f"pow2={pow2} {launch} step {step} {k}: the FP8 copy is not the updated weight's")
        opt.write_fp8_blocks(params["whole"], None, None, pow2=pow2)
        kept = copies["whole"][0].clone()
        params["whole"].grad = torch.randn(shapes["whole"], generator=g)
        opt.step()
        if not torch.equal(copies["whole"][0], kept):
            failures.append(f"pow2={pow2} {launch}: a copy let go was written")
    stranger = torch.nn.Parameter(torch.randn(128, 128))  # a parameter the optimizer does not step
    try:
        adamw.TritonAdamW([torch.nn.Parameter(torch.randn(8))], **_HP).write_fp8_blocks(
            stranger, torch.zeros(128, 128), torch.zeros(1, 1), pow2=True)
        failures.append("a copy of a parameter the optimizer does not step was taken")
    except ValueError:
        pass
    for bad, data, scale in ((torch.nn.Parameter(torch.randn(64)), torch.zeros(64, 1), torch.zeros(1, 1)),
                             (torch.nn.Parameter(torch.randn(128, 128)), torch.zeros(128, 128), None),
                             (torch.nn.Parameter(torch.randn(300, 200)), torch.zeros(300, 128), torch.zeros(3, 1)),
                             (torch.nn.Parameter(torch.randn(300, 200)), torch.zeros(300, 256), torch.zeros(2, 2))):
        try:
            adamw.TritonAdamW([bad], **_HP).write_fp8_blocks(bad, data, scale, pow2=True)
            failures.append(f"a copy {tuple(data.shape)} / {tuple(scale.shape)} of a {tuple(bad.shape)} parameter "
                            "was taken")
        except ValueError:
            pass
    return failures


def _fsdp_rank(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fp8train.train.optim import optimizer_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results, all_norms = [], []
        for sharded in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 10))
            if sharded:
                fully_shard(model)
            opt = adamw.TritonAdamW([{"params": list(model.parameters()), "weight_decay": 0.1}], lr=1e-2,
                                    betas=(0.9, 0.95))
            states, norms = [], []
            for step in range(4):
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
                model(x).square().sum().backward()  # every rank the same batch: FSDP's mean is exact
                # no clip in the first three: a sharded norm sums in another order, its last bit may differ
                norms.append(optimizer_step(opt, model, 0.5 if step == 3 else 0.0))
                opt.zero_grad(set_to_none=True)
                states.append([(p.full_tensor() if sharded else p).detach().clone() for p in model.parameters()])
            results.append(states)
            all_norms.append(norms)
        if rank == 0:
            same = all(torch.equal(_bits(a), _bits(b)) for s, t in zip(results[0][:3], results[1][:3])
                       for a, b in zip(s, t))
            clipped = max(((a - b).abs().max() / (a - c).abs().max()).item()
                          for a, b, c in zip(results[0][3], results[1][3], results[0][2]))
            shards = [tuple(p.to_local().shape) for p in model.parameters()]
            norm_diff = max(abs(a - b) / a for a, b in zip(*all_norms))  # the sharded norm, all-reduced
            Path(out).write_text(json.dumps({"same": same, "clipped_step_diff": clipped, "shards": shards,
                                             "norm_diff": norm_diff}))
    finally:
        dist.destroy_process_group()


def fsdp() -> dict:
    """Two CPU ranks (gloo), FSDP2: each steps its own shards (DTensors); the gathered parameters after three
    steps equal, bit for bit, one process stepping the whole model, and after a fourth, clipped, within
    rounding of the norm (relative to the step's move)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "fsdp.json")
        mp.spawn(_fsdp_rank, args=(2, port, out), nprocs=2)
        return json.loads(Path(out).read_text())


def compile_sm90() -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" for n in adamw._adamw_kernel.arg_names}
    sig.update(addr_ptr="*i64", hyper_ptr="*fp32", chunk_ptr="*i32", grad_scale_ptr="*fp32", decay="fp32",
               one_minus_beta1="fp32", beta2="fp32", one_minus_beta2="fp32", eps="fp32")
    from _triton_kernel_checks import _resources  # registers and stack, as the quantization kernels' check

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def resources(kernel, sig, consts, **options) -> dict:
        """`_resources`, and the fused multiply-adds in the SASS."""
        k = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": adamw._LAUNCH[2], **options})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True,
                                  check=True).stdout
        return {**_resources(k), "FFMA": len(re.findall(r"\bFFMA\b", sass))}

    out = {}
    for has_scale in (True, False):
        for fusion in (False, True):
            consts = dict(HAS_GRAD_SCALE=has_scale, BLOCK=adamw._LAUNCH[0], ITERS=adamw._LAUNCH[1])
            out[f"grad_scale={has_scale} fp_fusion={fusion}"] = resources(adamw._adamw_kernel, sig, consts,
                                                                          enable_fp_fusion=fusion)
    norm_sig = dict(addr_ptr="*i64", chunk_ptr="*i32", out_ptr="*fp32", BLOCK="constexpr", ITERS="constexpr")
    out["grad_norm"] = resources(adamw._sum_squares_kernel, norm_sig,
                                 dict(BLOCK=adamw._LAUNCH[0], ITERS=adamw._LAUNCH[1]))
    blocks_sig = {n: "constexpr" for n in adamw._adamw_blocks_kernel.arg_names}
    blocks_sig.update(addr_ptr="*i64", hyper_ptr="*fp32", block_ptr="*i32", fp8_ptr="*i64", grad_scale_ptr="*fp32",
                      found_inf_ptr="*fp32", decay="fp32", one_minus_beta1="fp32", beta2="fp32",
                      one_minus_beta2="fp32", eps="fp32")
    for pow2 in (True, False):
        consts = dict(HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, POW2=pow2, FP32_DATA=False, SIDE=adamw._SIDE,
                      ROWS=adamw._BLOCKS_LAUNCH[0])
        out[f"fp8 blocks pow2={pow2}"] = resources(adamw._adamw_blocks_kernel, blocks_sig, consts,
                                                   enable_fp_fusion=False, num_warps=adamw._BLOCKS_LAUNCH[1])
    return out


if __name__ == "__main__":
    print(json.dumps({"interpret": interpret, "fsdp": fsdp, "compile": compile_sm90}[sys.argv[1]]()))
