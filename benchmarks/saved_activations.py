"""What one decoder layer keeps for backward, BF16 vs FP8 recipes, eager and compiled (runs on a CPU).

    PYTHONPATH=. python benchmarks/saved_activations.py --models qwen2.5-1.5b qwen2.5-7b --tokens 600

Activation memory is the part of the peak that an FP8 recipe can change (weights, gradients and AdamW
states are FP32 in every variant), and it is a property of the autograd graph, not of the GPU: every
tensor saved for backward is recorded (saved-tensor hooks, one count per storage) while one layer of the
real shape runs forward under BF16 autocast. "compiled" uses AOTAutograd's min-cut partitioner, the one
inductor uses (backend `aot_eager_decomp_partition`: the same graph split, eager kernels). The parameters
themselves are not counted (they are alive anyway); other saved tensors with a weight's element count are
reported per parameter (BF16 autocast copies, FP8 weight copies); the rest per token. Token count: any size
that divides no layer width keeps the two kinds apart. Recipes take `fp8train bench`'s variant modifiers
(`hybrid+wgrad_from_fp8`).
"""

from __future__ import annotations

import argparse

import torch
import torch._dynamo


def saved_bytes(preset: str, recipe: str, compiled: bool, tokens: int) -> dict:
    from fp8train import convert_to_fp8, parse_recipe
    from fp8train.train.model import ModelConfig, build_model, decoder_layers

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(ModelConfig(source=preset, vocab_size=1024, num_layers=1))
    convert_to_fp8(model, parse_recipe(recipe))
    layer = decoder_layers(model)[0]
    fn = torch.compile(layer, backend="aot_eager_decomp_partition") if compiled else layer
    h = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    pos = torch.arange(tokens)[None]
    cos_sin = model.model.rotary_emb(h, pos)
    saved: dict[int, tuple[int, int]] = {}
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.numel())
        return t

    for _ in range(2):  # the first call compiles
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", torch.bfloat16):
                out = fn(h, position_embeddings=cos_sin, position_ids=pos)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    weight_sizes = {p.numel() for p in layer.parameters() if p.dim() == 2}
    params = sum(p.numel() for p in layer.parameters())
    w = sum(b for b, n in saved.values() if n in weight_sizes)
    act = sum(b for b, _ in saved.values()) - w
    return {"model": preset, "recipe": recipe, "compiled": compiled, "bytes_per_token": act / tokens,
            "bytes_per_param": w / params, "params": params, "hidden": model.config.hidden_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    p.add_argument("--recipes", nargs="+", default=["bf16", "hybrid", "tensorwise"])
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--seq", type=int, default=8192, help="tokens per step for the GiB-per-layer column")
    args = p.parse_args()
    print("| model | mode | recipe | saved activations, bytes per token | saved weight copies, bytes per param "
          f"| per layer at {args.seq} tokens, GiB | x BF16 |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        for compiled in (False, True):
            base = None
            for recipe in args.recipes:
                r = saved_bytes(model, recipe, compiled, args.tokens)
                gib = (r["bytes_per_token"] * args.seq + r["bytes_per_param"] * r["params"]) / 2**30
                base = base or gib
                print(f"| {model} | {'compiled' if compiled else 'eager'} | {recipe} | {r['bytes_per_token']:,.0f} "
                      f"({r['bytes_per_token'] / r['hidden']:.1f} x hidden) | {r['bytes_per_param']:.2f} | "
                      f"{gib:.3f} | {gib / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
