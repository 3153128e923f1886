"""Attention over packed documents: what a CPT/SFT row of several documents costs, by kernel (GPU).

    PYTHONPATH=. python benchmarks/packed_attention.py --docs 1 4 8 32 --out packed_attention.jsonl

Rows packed from several documents (CPT's `document_masking`, SFT's packing) restart `position_ids` at each
document. Hugging Face's SDPA path then builds a dense [B, 1, S, S] boolean mask (same document and causal) and
calls SDPA with it, which rules out the causal flash kernels; it also checks on the host whether a row is
packed at all (a wait for the GPU every forward). Timed here, forward + backward of one layer's attention on
the Qwen2.5 shapes, BF16, one row of `--seq` tokens split into documents of equal length:
  sdpa causal         what a row of one document runs (is_causal, no mask): the floor
  sdpa dense mask     what the trainer runs today for a packed row (Hugging Face's mask, built each forward)
  varlen              torch.nn.attention.varlen.varlen_attn (FlashAttention), causal within each document,
                      from cumulative document lengths (no mask)
  flex                torch.nn.attention.flex_attention with the document-causal block mask (compiled;
                      blocks outside every document skipped)
Every candidate's output and input gradients are checked against `sdpa dense mask` (max abs difference).
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F
from _harness import append_jsonl  # a sibling: benchmarks/ is on sys.path

SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}  # query heads, key/value heads, head dim


def _dense_mask(doc: torch.Tensor) -> torch.Tensor:
    s = doc.numel()
    causal = torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


def _sdpa(mask):
    def run(q, k, v, ctx):  # [1, H, S, D]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_dense_mask(ctx["doc"]), enable_gqa=True)
    return run


def _varlen():
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params

    def run(q, k, v, ctx):  # varlen takes [T, H, D]
        q_, k_, v_ = (t[0].transpose(0, 1) for t in (q, k, v))
        if not gqa:
            rep = q_.shape[1] // k_.shape[1]
            k_, v_ = k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1)
        extra = {"enable_gqa": True} if gqa else {}
        out = varlen_attn(q_, k_, v_, ctx["cu"], ctx["cu"], ctx["max"], ctx["max"], **causal, **extra)
        return out.transpose(0, 1)[None]
    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def run(q, k, v, ctx):
        if "block" not in ctx:
            doc = ctx["doc"]
            ctx["block"] = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (doc[qi] == doc[ki]), None, None,
                                             doc.numel(), doc.numel(), device=doc.device)
        return compiled(q, k, v, block_mask=ctx["block"], enable_gqa=True)
    return run


def _time(fn, q, k, v, ctx, reps: int) -> float:
    grad = torch.randn_like(q)
    for _ in range(3):
        fn(q, k, v, ctx).backward(grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(q, k, v, ctx).backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--docs", type=int, nargs="+", default=[1, 4, 8, 32])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = []
    candidates = {"sdpa dense mask": _sdpa("dense"), "varlen": None, "flex": None}
    for name, make in (("varlen", _varlen), ("flex", _flex)):
        try:
            candidates[name] = make()
        except Exception as e:  # absent from this torch: reported, not fatal
            print(f"{name}: unavailable ({type(e).__name__}: {e})", flush=True)
    for model in args.models:
        hq, hkv, d = SHAPES[model]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, args.seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (hq, hkv, hkv))
        floor = _time(_sdpa(None), q, k, v, {}, args.reps)
        rows.append({"model": model, "seq": args.seq, "docs": 1, "impl": "sdpa causal", "ms": floor})
        print(f"{model} causal, one document: {floor:.3f} ms", flush=True)
        for docs in args.docs:
            length = -(-args.seq // docs)
            doc = torch.arange(args.seq, device="cuda") // length
            cu = torch.tensor([min(i * length, args.seq) for i in range(docs + 1)], dtype=torch.int32, device="cuda")
            ctx = {"doc": doc, "cu": cu, "max": length}
            ref_out, ref_grads = None, None
            for impl, fn in candidates.items():
                if fn is None:
                    continue
                try:
                    for t in (q, k, v):
                        t.grad = None
                    out = fn(q, k, v, ctx)
                    out.backward(torch.ones_like(out))
                    grads = [t.grad.clone() for t in (q, k, v)]
                    if ref_out is None:
                        ref_out, ref_grads, diff = out.detach(), grads, 0.0
                    else:
                        diff = max([(out.detach() - ref_out).abs().max().item()]
                                   + [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)])
                    ms = _time(fn, q, k, v, ctx, args.reps)
                except Exception as e:
                    print(f"{model} {docs} docs {impl}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row = {"model": model, "seq": args.seq, "docs": docs, "impl": impl, "ms": ms,
                       "x_causal_floor": ms / floor, "max_abs_diff_vs_dense": diff}
                rows.append(row)
                print(f"{model} {docs} docs of {length}: {impl:16s} {ms:8.3f} ms  {ms / floor:5.2f}x the causal "
                      f"floor  max |diff| {diff:.3g}", flush=True)
    for r in rows:
        append_jsonl(args.out, {**r, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    return rows


if __name__ == "__main__":
    main()
