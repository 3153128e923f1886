"""Device check of the serving export: transformers loads the fp8-block export, the exported E4M3 blocks
run in real FP8 GEMMs, and the logits on real text match the BF16 export.

    PYTHONPATH=. python benchmarks/check_export_gpu.py [--source DIR] [--out results.json]

Without --source it builds a Qwen2.5-0.5B-shaped model (2 layers, random init) and exports it. Two FP8
models are compared with the BF16 export, by the relative RMS logit difference and the next-token top-1
agreement on Python standard-library source text:
- transformers' own loader (FineGrainedFP8): with its `kernels` package it runs FP8 matmuls; without it
  (it fetches kernels from a hub) it dequantizes the 128x128 blocks on load;
- "served": the BF16 model with every exported projection replaced by the exported E4M3 weight and its
  `weight_scale_inv`, run as serving engines do (vLLM / SGLang block FP8): activations quantized per
  token in 1x128 groups with exact scales, cuBLAS blockwise FP8 GEMM with FP32 accumulation. This reads
  the exported bytes and scales exactly as written: a wrong scale convention or layout shows here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from fp8train.export import export_hf
from fp8train.data import load_tokenizer
from fp8train.export import export_checkpoint
from fp8train.train.model import ModelConfig, build_model
from fp8train.fp8.recipe import Fp8Format


class _ServedFp8Linear(torch.nn.Module):
    """y = x @ W.T from an fp8-block export's E4M3 weight and weight_scale_inv, as block-FP8 serving runs it."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None, cublas: bool):
        super().__init__()
        from fp8train.fp8.operands import LinearPlan, pad_operand
        from fp8train.fp8.recipe import make_recipe

        # the hybrid recipe's output GEMM: 1x128 activation tiles x the exported 128x128 weight blocks
        self.plan = LinearPlan.of(make_recipe("hybrid"), cublas)  # cuBLAS: K padded to 512, else emulated
        self.w = pad_operand(weight.contiguous(), scale_inv.float().contiguous(), self.plan.w)
        self.bias = bias

    def forward(self, x):
        from fp8train.fp8 import ops
        from fp8train.fp8.gemm import gemm

        x2d = x.reshape(-1, x.shape[-1])
        xa, xa_s, _, _ = ops.quantize_input(x2d, self.plan, make_cols=False)
        y = gemm(xa, xa_s, self.plan.x, *self.w, self.plan.w, torch.bfloat16, self.plan.cublas)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


def _served_fp8(fp8_dir: Path, bf16_dir: Path, device: str, cublas: bool):
    """The BF16 export with each exported FP8 projection swapped for `_ServedFp8Linear` (cuBLAS FP8 GEMMs,
    or their FP32 emulation on the same quantized operands); and how many were swapped."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(fp8_dir).glob("*.safetensors")):
        tensors.update(load_file(f, device=device))
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map=device)
    n = 0
    for name, module in list(model.named_modules()):
        w = tensors.get(f"{name}.weight")
        if isinstance(module, torch.nn.Linear) and w is not None and w.dtype == torch.float8_e4m3fn:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    _ServedFp8Linear(w, tensors[f"{name}.weight_scale_inv"], module.bias, cublas))
            n += 1
    return model.eval(), n


def _loaded_weight_error(model, fp8_dir: Path) -> float | None:
    """Largest relative difference between a dequantized-on-load weight of transformers and the exported
    E4M3 blocks times weight_scale_inv (None when transformers kept FP8 weights: nothing to compare)."""
    from safetensors.torch import load_file

    from fp8train.fp8.quant import Fp8Tensor, dequantize

    tensors = {}
    for f in sorted(Path(fp8_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    worst = 0.0
    for name, module in model.named_modules():
        w = tensors.get(f"{name}.weight")
        if w is None or w.dtype != torch.float8_e4m3fn or not hasattr(module, "weight"):
            continue
        if module.weight.dtype == torch.float8_e4m3fn:
            return None
        ref = dequantize(Fp8Tensor(w, tensors[f"{name}.weight_scale_inv"].float(), (128, 128), Fp8Format.E4M3))
        got = module.weight.detach().float().cpu()
        worst = max(worst, float(((got - ref).abs() / ref.abs().clamp_min(1e-30))[ref != 0].max()))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu to smoke-test (emulated GEMMs, dequantized load)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="export-check-"))
    tok = load_tokenizer("qwen2.5")
    src = args.source
    if src is None:
        torch.manual_seed(0)
        model = build_model(ModelConfig(source="qwen2.5-0.5b", num_layers=2))
        src = export_hf(model, work / "src", tok, dtype=torch.float32)
    bf16_dir = export_checkpoint(src, work / "bf16", format="hf")
    fp8_dir = export_checkpoint(src, work / "fp8", format="fp8-block")
    bf16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map=args.device)
    import importlib.util

    if importlib.util.find_spec("kernels") is not None:  # transformers' FP8 matmuls come from `kernels`
        mode = "fp8 kernels"
        fp8 = AutoModelForCausalLM.from_pretrained(fp8_dir, device_map=args.device)
    else:  # without it (no hub access either) the loader can still dequantize the 128x128 blocks
        from transformers import FineGrainedFP8Config

        mode = "dequantized on load (no `kernels` package)"
        fp8 = AutoModelForCausalLM.from_pretrained(fp8_dir, device_map=args.device, dtype=torch.bfloat16,
                                                   quantization_config=FineGrainedFP8Config(dequantize=True))
    served, n_served = _served_fp8(fp8_dir, bf16_dir, args.device, cublas=args.device == "cuda")
    emulated, _ = _served_fp8(fp8_dir, bf16_dir, args.device, cublas=False)
    weight_err = _loaded_weight_error(fp8, fp8_dir)
    proj = fp8.model.layers[0].self_attn.q_proj
    text = inspect.getsource(json) + inspect.getsource(inspect)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens].to(args.device)
    with torch.no_grad():
        a, b, c, e = (m(input_ids=ids).logits.double() for m in (bf16, fp8, served, emulated))

    def rel(x, ref):
        return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())

    # one exported projection on the same input: the cuBLAS FP8 GEMM against its emulation
    q_served, q_emul = served.model.layers[0].self_attn.q_proj, emulated.model.layers[0].self_attn.q_proj
    xq = torch.randn(1024, bf16.config.hidden_size, device=args.device,
                     dtype=torch.bfloat16)
    with torch.no_grad():
        layer_sqnr = float(-20 * torch.log10(torch.tensor(rel(q_served(xq).double(), q_emul(xq).double()))))
    res = {"load_mode": mode, "q_proj_type": type(proj).__name__, "q_proj_weight_dtype": str(proj.weight.dtype),
           "tokens": ids.shape[1], "hf_loaded_weight_max_rel_err": weight_err,
           "hf_fp8_vs_bf16_rel_rms": rel(b, a), "served_fp8_gemm_layers": n_served,
           "served_vs_bf16_rel_rms": rel(c, a), "emulated_vs_bf16_rel_rms": rel(e, a),
           "served_q_proj_vs_emulated_sqnr_db": layer_sqnr,
           "served_vs_emulated_logits_sqnr_db": float(-20 * torch.log10(torch.tensor(rel(c, e)))),
           "served_vs_emulated_top1": float((c.argmax(-1) == e.argmax(-1)).float().mean())}
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    # Bounds: transformers' dequantized weights are the exported blocks times their scales (one BF16 rounding
    # step, measured 2^-8 on CPU: it multiplies in BF16; bound 2^-7); one cuBLAS FP8 GEMM on the exported
    # operands matches its FP32 emulation up to summation order and the BF16 output (> 38 dB, as
    # tests/test_gpu.py); through the model, tiny differences move activations across FP8 rounding
    # boundaries, so the served logits are judged by their distance to BF16, which must be that of the
    # emulation within 25%; and E4M3 weights keep the logits within 20% RMS of BF16 even on this random-init
    # model, whose logits are small and nearly tied.
    ok = ((mode != "fp8 kernels" or "float8" in res["q_proj_weight_dtype"]) and n_served > 0
          and (weight_err is None or weight_err <= 2 ** -7) and layer_sqnr > 38
          and res["served_vs_bf16_rel_rms"] < 1.25 * res["emulated_vs_bf16_rel_rms"]
          and res["hf_fp8_vs_bf16_rel_rms"] < 0.2 and res["served_vs_bf16_rel_rms"] < 0.2)
    print("export check:", "PASS" if ok else "FAIL (see numbers)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
