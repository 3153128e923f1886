"""The `fp8train` command: train | plot | demo | export | eval | bench.

    fp8train train configs/tiny_cpt.yaml optim.lr=3e-4 recipe=bf16
    fp8train train --help-config
    fp8train plot runs/fp8 runs/bf16 -o loss.png
    fp8train demo
    fp8train bench --models qwen2.5-1.5b --seq 8192      # BF16 vs FP8 vs torchao on this GPU
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

__all__ = ["main", "build_parser", "keep_freed_memory"]

# Errors of the user's making (a config, a file, data, a missing optional package): one line and exit code 2.
# The code raises these with a message that names the key or file; anything else is a bug of ours and
# keeps its traceback (exit code 1). --traceback shows the traceback of any error.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ModuleNotFoundError)


def _run_train(args: argparse.Namespace) -> int:
    from .train.config import format_config_help, load_config

    if args.help_config:
        print(format_config_help())
        return 0
    config, overrides = None, list(args.args)
    if overrides and "=" not in overrides[0]:
        config = overrides.pop(0)
    if config is None:
        raise ValueError("give a config file: fp8train train CONFIG.yaml [key=value ...] (presets in configs/)")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"overrides must be key=value, got {bad}")
    args.overrides = overrides  # errors after loading name the override they come from
    cfg = load_config(config, overrides)

    from .train.trainer import train

    result = train(cfg, progress=not args.no_progress)
    if not result.is_main:  # under torchrun rank 0 alone reports
        return 0
    last = result.losses.get(result.step)
    print(f"finished {cfg.run_dir}: step {result.step}"
          + (f", loss {last:.4f}" if last is not None else "")
          + (f", val_loss {result.val_loss:.4f}" if result.val_loss is not None else "")
          + (f", {result.skipped_steps} skipped steps" if result.skipped_steps else ""))
    return 0


# An error about one record starts with where it is: `file:line: ` (JSONL) or `<source> row N: ` (tables; a
# data.hf_dataset's name follows "data.hf_dataset: ").
_DATA_LOCATION = re.compile(r"(data\.hf_dataset: )?[^:]+(:\d+| row \d+): ")


def _blame_override(message: str, overrides: list[str]) -> str:
    """Prefix an error that names a dotted key set on the command line with the override as typed; not one
    about a record, which names the keys that read it (the record is at fault, not the override)."""
    if _DATA_LOCATION.match(message):
        return message
    typed = {o.partition("=")[0].strip(): o for o in overrides}  # the last one of a key is the one in force
    for key, item in sorted(typed.items(), key=lambda kv: -len(kv[0])):
        if item in message:
            return message
        if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message):
            return f"{item} (command line): {message}"
    return message


def _run_plot(args: argparse.Namespace) -> int:
    from .plot import plot_runs

    out = plot_runs(args.run_dirs, args.output, smooth=args.smooth, title=args.title)
    print(f"wrote {out}")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    run_demo(DemoConfig(out_dir=args.out, device=args.device, steps=args.steps, cpu_threads=args.threads or None,
                        parallel=not args.sequential))
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8train", description="End-to-end FP8 training (CPT and SFT) of "
                                     "Hugging Face causal LMs with the InfiR2 hybrid-granularity recipe.")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="continual pretraining or SFT from a YAML config",
                       description="Train from a YAML config (presets in configs/) with dotted key=value "
                       "overrides, e.g. `fp8train train configs/tiny_cpt.yaml optim.lr=3e-4 recipe=bf16`.")
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml [key=value ...]",
                   help="config file, then overrides (values are YAML scalars)")
    p.add_argument("--help-config", action="store_true", help="list every config key with its meaning and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.set_defaults(func=_run_train)

    p = sub.add_parser("plot", help="overlay the loss curves of runs (FP8 vs BF16)",
                       description="Overlay the training loss (left) and validation loss (right) of training runs, "
                       "read from each RUN_DIR/metrics.jsonl, e.g. `fp8train plot runs/fp8 runs/bf16 -o loss.png`.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories of `fp8train train` (each holds metrics.jsonl); the legend names each by "
                        "its folder and recipe")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png",
                   help="image to write; .png is appended unless the name ends in a format matplotlib writes "
                        "(.png, .svg, .pdf, ...)")
    p.add_argument("--smooth", type=float, default=0.0,
                   help="EMA factor for the training curves, in [0, 1) (default 0: raw; the raw curve stays "
                        "faintly behind a smoothed one)")
    p.add_argument("--title", default=None, help="figure title (default: none)")
    p.set_defaults(func=_run_plot)

    p = sub.add_parser("demo", help="FP8 vs BF16 end to end, small: CPT, SFT, evaluation, fp8-block export",
                       description="A small Qwen2-architecture model with the Qwen2.5 tokenizer, in FP8 (hybrid) "
                       "and BF16 with the same seed and data: CPT on the Python standard library sources, SFT "
                       "on a generated chat task, evaluation of both, an fp8-block export of the FP8 model; "
                       "prints one table and writes OUT/loss.png and OUT/sft_loss.png. Uses the GPU when there "
                       "is one.")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps", type=int, default=None, help="override the number of steps")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on a CPU (default 1, fastest on a busy machine; 0 = torch's default)")
    p.add_argument("--sequential", action="store_true",
                   help="on a CPU, run the FP8 and BF16 arms one after the other instead of side by side in two "
                        "processes (the default where there is a core for each arm's threads)")
    p.set_defaults(func=_run_demo)

    from .bench import build_parser as build_bench_parser

    p = sub.add_parser("bench", help="time the training step: BF16 vs the FP8 recipes vs torchao, on this GPU",
                       description="End-to-end training-step benchmark (the table of docs/benchmarks.md): every "
                       "variant runs the trainer's own step on the same data, BF16 first, ratios to it.")
    build_bench_parser(p).set_defaults(func=_run_bench)

    from .eval import add_cli as add_eval_cli
    from .export import add_cli as add_export_cli

    add_export_cli(sub)
    add_eval_cli(sub)
    return parser


def keep_freed_memory() -> None:
    """Ask glibc to serve large blocks from the heap and never trim it.

    A training step frees and re-allocates the same large activation buffers (on the CPU the
    [tokens, 151936] logits alone are hundreds of MB), and by default glibc returns each one to the
    kernel (mmap/munmap), so every step page-faults all of it in again. In a VM that made a CPU step
    7-15x slower. This command owns its process, so it trades returning memory for speed; elsewhere
    (musl, macOS) nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold, int_max = -1, -3, 2**31 - 1
    libc.mallopt(m_mmap_threshold, int_max)
    libc.mallopt(m_trim_threshold, int_max)


def _no_hub_info(record: logging.LogRecord) -> bool:
    """huggingface_hub's INFO lines stay out (one names the temporary folder an export is written to before its
    rename; ours names the result). Its loggers are named by file path, hence the path."""
    return record.levelno >= logging.WARNING or "huggingface_hub" not in record.pathname


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`train CONFIG --no-progress a=1`), which argparse would split off.
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "train" or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.args = list(args.args) + extra
    keep_freed_memory()
    if args.command in ("train", "demo"):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint would bury ours
    # under torchrun (its RANK) the other ranks log warnings only: rank 0's INFO lines are every rank's
    rank0 = os.environ.get("RANK", "0") in ("", "0")
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_no_hub_info)
    from .train.checkpoint import CorruptCheckpointError
    from .train.trainer import NonFiniteLossError

    try:
        return int(args.func(args) or 0)
    except (*_USER_ERRORS, CorruptCheckpointError, NonFiniteLossError) as e:
        if args.traceback:
            raise
        message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message held
        if isinstance(e, ModuleNotFoundError) and "pip install" not in message:
            message += f" (pip install {e.name or 'the missing package'})"
        if args.command == "train":
            message = _blame_override(message, getattr(args, "overrides", []))
        print(f"fp8train {args.command}: error: {message}", file=sys.stderr)
        return 1 if isinstance(e, NonFiniteLossError) else 2
    except KeyboardInterrupt:
        print(f"fp8train {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
