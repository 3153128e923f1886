"""LM head + causal-LM loss, forward and backward: the plain HF path against chunked and fused versions.

    PYTHONPATH=. python benchmarks/lm_head_loss.py                       # GPU: Qwen2.5-7B and 1.5B head shapes
    PYTHONPATH=. python benchmarks/lm_head_loss.py --device cpu --shapes 96x64x320 --reps 1 --warmup 0

Per shape (tokens x hidden x vocabulary; FP32 hidden states and head weight, BF16 autocast, as in
`Trainer.train_step`) and implementation, one forward + backward: time (median over `--reps` after
`--warmup`, CUDA events) and peak memory above the inputs (the gradients of the hidden states and the
weight included, as they stay). Implementations:
  hf                today's path: `lm_head` under autocast (BF16 logits, kept by the output as in the
                    trainer), then transformers' ForCausalLMLoss (FP32 logits, cross-entropy, / n)
  chunked           fp8train.train.loss.linear_cross_entropy, eager (per `--chunk-tokens`)
  chunked-compiled  the same with its per-chunk softmax/gradient under torch.compile (`train.compile`)
  liger             Liger's fused linear cross-entropy (`liger-kernel`, Triton), when importable
Each result is checked against an FP64 reference (chunked, on the same device) with the first-order BF16
bound of `reference_and_bound` (the bound tests/test_loss.py uses), and against `hf`: both within the
bound of FP64 means |x - hf| <= 2x the allowance. Prints a markdown table; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

U = 2.0**-8  # BF16 unit roundoff
SLACK = 1.25  # allowance for second-order terms of the first-order bound
IMPLS = ("hf", "chunked", "chunked-compiled", "liger")


def reference_and_bound(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, n, chunk: int = 1024):
    """FP64 logits + cross-entropy (loss / n, grad wrt h as [tokens, hidden], grad wrt w) and first-order
    bounds of the error of a computation that rounds h, w and the logits to BF16 and accumulates in FP32.

    With K = hidden, |dz| <= Dz = (3u + K 2**-24) |h| |w|^T; P the softmax, Y the one-hot targets,
    G = (P - Y) / n on target rows:
      loss:           sum_i sum_j |P - Y|_ij Dz_ij / n
      dG:             |dG_ij| <= P_ij (Dz_ij + sum_k P_ik Dz_ik) / n + u |G_ij|   (softmax, BF16 rounding)
      grad_h = G w:   |dG| |w| + u |G| |w| + u |G w|     (w in BF16, output rounded to BF16)
      grad_w = G^T h: |dG|^T |h| + 2u |G|^T |h|          (h in BF16, per-chunk products rounded to BF16)
    Returns (loss, grad_h, grad_w, (loss_bound, grad_h_bound, grad_w_bound)), FP64; chunked over tokens.
    """
    x = h.detach().reshape(-1, h.shape[-1]).double()
    w64 = w.detach().double()
    w_abs = w64.abs()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(x.device)
    n = float(n)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    b_loss = torch.zeros_like(loss)
    gh, b_gh = torch.empty_like(x), torch.empty_like(x)
    gw, b_gw = torch.zeros_like(w64), torch.zeros_like(w64)
    factor = 3 * U + x.shape[-1] * 2.0**-24
    for s in range(0, x.shape[0], chunk):
        xc, t = x[s:s + chunk], targets[s:s + chunk]
        valid = (t != -100).double().unsqueeze(-1)
        z = xc @ w64.T
        p = torch.softmax(z, -1)
        loss += F.cross_entropy(z, t, ignore_index=-100, reduction="sum") / n
        g = p.clone()
        g[torch.arange(len(t), device=x.device), t.clamp(min=0)] -= 1.0
        g *= valid / n  # (P - Y) / n on target rows
        dz = factor * (xc.abs() @ w_abs.T)
        b_loss += ((g.abs() * n) * dz).sum() / n
        dg = p * (dz + (p * dz).sum(-1, keepdim=True)) * valid / n + U * g.abs()
        del z, dz, p
        gh[s:s + chunk] = g @ w64
        b_gh[s:s + chunk] = dg @ w_abs + U * (g.abs() @ w_abs) + U * gh[s:s + chunk].abs()
        gw += g.T @ xc
        b_gw += dg.T @ xc.abs() + 2 * U * (g.abs().T @ xc.abs())
    return loss.item(), gh, gw, (b_loss.item(), b_gh, b_gw)


def allowance(ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """SLACK x the bound, plus 2**-20 of the largest reference value (FP32 exp/log and sums)."""
    return SLACK * bound + 2.0**-20 * ref.abs().max()


def _ratio(got: torch.Tensor, ref: torch.Tensor, allowed: torch.Tensor) -> float:
    return ((got.double() - ref).abs() / allowed).max().item()


def _loss_fn(impl: str, chunk: int | None, vocab: int):
    from transformers.loss.loss_utils import ForCausalLMLoss

    from fp8train.train.loss import linear_cross_entropy

    if impl == "hf":
        def hf(h, w, labels, n):
            logits = F.linear(h, w)
            return ForCausalLMLoss(logits, labels, vocab, num_items_in_batch=n), logits  # logits live on
        return hf
    compile = impl == "chunked-compiled"
    name = "liger" if impl == "liger" else "chunked"
    return lambda h, w, labels, n: (linear_cross_entropy(h, w, labels, n, impl=name, chunk_tokens=chunk,
                                                         compile=compile), None)


def _available(impl: str, device: str) -> bool:
    if impl != "liger":
        return True
    if device != "cuda":
        return False
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as e:
        print(f"liger: not importable ({e}); skipped", flush=True)
        return False
    return True


def run_shape(tokens: int, hidden: int, vocab: int, *, device: str, impls, chunks, reps: int, warmup: int,
              seed: int = 0) -> list[dict]:
    import time

    from fp8train.train.loss import _chunk_size

    cuda = device == "cuda"
    g = torch.Generator(device=device).manual_seed(seed)
    # the final RMSNorm's output (~unit scale) and a head at init scale: logits of std ~0.02 sqrt(hidden)
    h = torch.randn(1, tokens, hidden, device=device, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device=device, generator=g)
    labels[torch.rand(labels.shape, device=device, generator=g) < 0.1] = -100  # SFT-like masked tokens
    n = (labels[:, 1:] != -100).sum()
    ref_loss, ref_gh, ref_gw, (b_loss, b_gh, b_gw) = reference_and_bound(h, w, labels, n.item())
    a_loss, a_gh, a_gw = SLACK * b_loss + 2.0**-20 * abs(ref_loss), allowance(ref_gh, b_gh), allowance(ref_gw, b_gw)
    del b_gh, b_gw

    def once(fn):
        h.grad = w.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            loss, keep = fn(h, w, labels, n)
        loss.backward()
        del keep
        return loss.item()

    results, hf = [], None
    for impl in impls:
        for chunk in (chunks if impl.startswith("chunked") else [None]):
            if not _available(impl, device):
                continue
            fn = _loss_fn(impl, chunk, vocab)
            try:
                for _ in range(warmup):
                    once(fn)
            except Exception as e:  # an implementation that fails to run (OOM, a Liger/Triton mismatch) is reported
                print(f"{impl} (chunk {chunk}) at {tokens}x{hidden}x{vocab}: FAILED {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
                h.grad = w.grad = None
                if cuda:
                    torch.cuda.empty_cache()
                continue
            times, peak = [], float("nan")
            for _ in range(max(1, reps)):
                h.grad = w.grad = None  # the last run's gradients are not part of this one's memory
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                loss = once(fn)  # .item() waits for the forward; the synchronize below for the backward
                if cuda:
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                times.append((time.perf_counter() - t0) * 1e3)
            gh, gw = h.grad.detach().reshape(-1, hidden), w.grad.detach()
            r = {"shape": f"{tokens}x{hidden}x{vocab}", "impl": impl, "ms": statistics.median(times),
                 "chunk": None if impl in ("hf", "liger") else _chunk_size(tokens, vocab, chunk), "peak_gib": peak,
                 "loss": loss, "loss_err": abs(loss - ref_loss) / a_loss, "gh_err": _ratio(gh, ref_gh, a_gh),
                 "gw_err": _ratio(gw, ref_gw, a_gw), "vs_hf": None}
            if impl == "hf":
                hf = (loss, gh.double(), gw.double())
            if hf is not None:  # both within the bound of FP64: within twice the bound of each other
                r["vs_hf"] = max(abs(loss - hf[0]) / (2 * a_loss), _ratio(gh, hf[1], 2 * a_gh), _ratio(gw, hf[2], 2 * a_gw))
            r["ok"] = max(r["loss_err"], r["gh_err"], r["gw_err"], r["vs_hf"] or 0.0) <= 1.0
            results.append(r)
            print(r, flush=True)
            h.grad = w.grad = None
            del gh, gw
            if cuda:
                torch.cuda.empty_cache()
    return results


def markdown_table(results: list[dict]) -> str:
    lines = ["| tokens x hidden x vocab | impl | chunk tokens | fwd+bwd ms | peak GiB above inputs | loss "
             "| loss err / bound | grad_h err / bound | grad_W err / bound | diff to hf / 2x bound | check |",
             "|" + "---|" * 11]
    for r in results:
        vs = "-" if r["vs_hf"] is None else f"{r['vs_hf']:.3f}"
        lines.append(f"| {r['shape']} | {r['impl']} | {r['chunk'] or '-'} | {r['ms']:.2f} | {r['peak_gib']:.2f} | "
                     f"{r['loss']:.5f} | {r['loss_err']:.3f} | {r['gh_err']:.3f} | {r['gw_err']:.3f} | {vs} | "
                     f"{'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines)


def _shape(spec: str) -> tuple[int, int, int]:
    parts = spec.lower().split("x")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"shape {spec!r} is not TOKENSxHIDDENxVOCAB")
    return tuple(int(p) for p in parts)


def _chunk(spec: str) -> int | None:
    return None if spec == "auto" else int(spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=_shape, default=[(8192, 3584, 151936), (8192, 1536, 151936)],
                   metavar="TOKENSxHIDDENxVOCAB", help="default: Qwen2.5-7B and 1.5B heads at 8192 tokens")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--chunk-tokens", nargs="+", type=_chunk, default=[None, 1024, 4096], metavar="N|auto",
                   help="chunk sizes of the chunked rows; auto = the trainer's default (2**28 logits a chunk)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (torch.compile compiles here)")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the harness on small shapes (no timing)")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import importlib.metadata as md

        try:
            liger = md.version("liger-kernel")
        except md.PackageNotFoundError:
            liger = "not installed"
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, liger-kernel {liger}", flush=True)
    results = []
    for tokens, hidden, vocab in args.shapes:
        rows = run_shape(tokens, hidden, vocab, device=args.device, impls=args.impls, chunks=args.chunk_tokens,
                         reps=args.reps, warmup=args.warmup)
        results += rows
    print("\n" + markdown_table(results), flush=True)
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
