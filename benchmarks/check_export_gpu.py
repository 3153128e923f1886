"""Device check of the serving export: transformers loads the fp8-block export and runs real FP8 GEMMs,
and its logits on real text match the BF16 export.

    PYTHONPATH=. python benchmarks/check_export_gpu.py [--source DIR] [--out results.json]

Without --source it builds a Qwen2.5-0.5B-shaped model (2 layers, random init; every projection is a
whole number of 128x128 blocks) and exports it. Reports the relative RMS logit difference and the
next-token top-1 agreement between the two exports on Python standard-library source text.
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

from fp8train.checkpoint import export_hf
from fp8train.data import load_tokenizer
from fp8train.export import export_checkpoint
from fp8train.model import ModelConfig, build_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default=None)
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
    bf16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map="cuda")
    import importlib.util

    if importlib.util.find_spec("kernels") is not None:  # transformers' FP8 matmuls come from `kernels`
        mode = "fp8 kernels"
        fp8 = AutoModelForCausalLM.from_pretrained(fp8_dir, device_map="cuda")
    else:  # without it (no hub access either) the loader can still dequantize the 128x128 blocks
        from transformers import FineGrainedFP8Config

        mode = "dequantized on load (no `kernels` package)"
        fp8 = AutoModelForCausalLM.from_pretrained(fp8_dir, device_map="cuda", dtype=torch.bfloat16,
                                                   quantization_config=FineGrainedFP8Config(dequantize=True))
    proj = fp8.model.layers[0].self_attn.q_proj
    text = inspect.getsource(json) + inspect.getsource(inspect)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens].cuda()
    with torch.no_grad():
        a = bf16(input_ids=ids).logits.float()
        b = fp8(input_ids=ids).logits.float()
    rel_rms = float((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt())
    top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    res = {"load_mode": mode, "q_proj_type": type(proj).__name__, "q_proj_weight_dtype": str(proj.weight.dtype),
           "tokens": ids.shape[1], "rel_rms_logits": rel_rms, "top1_agreement": top1}
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    ok = (mode != "fp8 kernels" or "float8" in res["q_proj_weight_dtype"]) and rel_rms < 0.1 and top1 > 0.9
    print("export check:", "PASS" if ok else "FAIL (see numbers)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
