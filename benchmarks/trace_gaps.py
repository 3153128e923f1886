"""Where a profiled step leaves the GPU idle: the gaps between its kernels, read from a Chrome trace.

    python benchmarks/trace_gaps.py TRACE.json.gz [...] --top 15

The traces are what `fp8train bench --trace DIR` and `benchmarks/lora_gpu.py --trace DIR` write (torch.profiler,
Kineto's format). The GPU is busy while any kernel, copy or memset runs; an idle gap is time between two
busy spans inside the step's window (first kernel start to last kernel end). "median step - kernels" in the
profile tables is this idle time plus the host's time before the first kernel and after the last (both
printed), plus whatever separates the profiled step from the timed steps' median.

Each gap is told by the kernel that ends it: the host op that launched it (through the launch's correlation id:
the innermost CPU op around the launch call, and the outermost below the profiler's step marker) and whether
the launch call began after the GPU had gone idle ("host": the GPU waited for the host to issue work) or
before ("queued": the work was issued in time and the GPU waited on something else, such as a stream event,
a copy or a CUDA graph's own launch latency). Gaps are summed by that outermost op, so the table says which
part of the step (a compiled layer's forward or backward, the optimizer, the loss read) starves the GPU.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
             "cudaMemcpyAsync", "cudaMemsetAsync")


@dataclass(frozen=True)
class Gap:
    start_us: float
    """From the window's start (the first kernel's start)."""
    us: float
    before: str
    """The device activity that ends where the gap begins."""
    after: str
    """The one that begins where the gap ends."""
    op: str
    """The innermost CPU op around the launch of `after` ("?" where the trace has no link)."""
    context: str
    """The outermost CPU op around it, below the profiler's step marker."""
    host_bound: bool
    """The launch call began after the GPU went idle."""


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


class _Thread:
    """One host thread's CPU ops as the tree they form (ops on a thread nest), for "which ops were running at t"."""

    def __init__(self, ops: list[dict]):
        self.ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.ops]
        self.parent: list[int | None] = []
        stack: list[int] = []
        for i, e in enumerate(self.ops):
            while stack and self._end(stack[-1]) < e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else None)
            stack.append(i)

    def _end(self, i: int) -> float:
        return self.ops[i]["ts"] + self.ops[i]["dur"]

    def around(self, t: float) -> tuple[str, str]:
        """(innermost, outermost) name of the ops running at t; "?" for none."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i is not None and i >= 0 and self._end(i) < t:
            i = self.parent[i]
        if i is None or i < 0:
            return "?", "?"
        inner = i
        while self.parent[i] is not None:
            i = self.parent[i]
        return self.ops[inner]["name"], self.ops[i]["name"]


_BUCKETS_US = (5.0, 50.0, 500.0)


def gaps(events: list[dict], min_us: float = 1.0) -> tuple[dict, list[Gap]]:
    """(summary, gaps) of one trace: window, busy and idle microseconds, launches, and every gap of at least
    `min_us` between the device's busy spans, in time order."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES]
    if not spans:
        raise ValueError("no GPU kernels in the trace (a CPU run, or the profiler recorded no CUDA activity)")
    spans.sort(key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in _LAUNCHES
                and "correlation" in e.get("args", {})}
    ops_by_thread = defaultdict(list)
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
                and not e["name"].startswith("ProfilerStep")):
            ops_by_thread[(e.get("pid"), e.get("tid"))].append(e)
    threads = {k: _Thread(v) for k, v in ops_by_thread.items()}

    def around(launch: dict) -> tuple[str, str]:
        thread = threads.get((launch.get("pid"), launch.get("tid")))
        return thread.around(launch["ts"]) if thread else ("?", "?")

    t0, found, busy_until, last, busy = spans[0]["ts"], [], spans[0]["ts"], spans[0], 0.0
    for e in spans:
        end = e["ts"] + e["dur"]
        if e["ts"] - busy_until >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            op, context = around(launch) if launch else ("?", "?")
            found.append(Gap(busy_until - t0, e["ts"] - busy_until, last["name"], e["name"], op, context,
                             launch is not None and launch["ts"] >= busy_until))
        if end > busy_until:
            busy += end - max(e["ts"], busy_until)
            busy_until, last = end, e
    window = busy_until - t0
    edges = (min_us, *_BUCKETS_US, float("inf"))
    host = [e for thread in threads.values() for e in thread.ops]
    summary = {"window_us": window, "busy_us": busy, "idle_us": window - busy, "gaps": len(found),
               "host_bound_us": sum(g.us for g in found if g.host_bound),
               # the host's work before the first kernel and after the last (outside the window)
               "host_lead_us": max(0.0, t0 - min(e["ts"] for e in host)) if host else 0.0,
               "host_tail_us": max(0.0, max(e["ts"] + e["dur"] for e in host) - busy_until) if host else 0.0,
               "kernels": sum(e.get("cat") == "kernel" for e in spans),
               "by_length": [(lo, hi, sum(g.us for g in found if lo <= g.us < hi), sum(lo <= g.us < hi for g in found))
                             for lo, hi in zip(edges, edges[1:])]}
    return summary, found


def by_context(found: list[Gap]) -> list[tuple[str, float, float, int]]:
    """(context, idle us, of it host-bound us, gaps), the largest first."""
    acc = defaultdict(lambda: [0.0, 0.0, 0])
    for g in found:
        a = acc[g.context]
        a[0] += g.us
        a[1] += g.us if g.host_bound else 0.0
        a[2] += 1
    return sorted(((c, *v) for c, v in acc.items()), key=lambda r: -r[1])


def report(name: str, summary: dict, found: list[Gap], top: int) -> list[str]:
    s = summary
    lines = [f"## {name}", "",
             f"window {s['window_us'] / 1e3:.1f} ms (first kernel start to last kernel end), GPU busy "
             f"{s['busy_us'] / 1e3:.1f} ms, idle {s['idle_us'] / 1e3:.1f} ms in {s['gaps']} gaps ({s['host_bound_us'] / 1e3:.1f} ms "
             f"of it host-bound); {s['kernels']} kernels. Outside the window the host works "
             f"{s['host_lead_us'] / 1e3:.1f} ms before the first kernel and {s['host_tail_us'] / 1e3:.1f} ms after "
             "the last.", "",
             "| gap length | idle ms | gaps |", "|---|---|---|"]
    lines += [f"| {lo:g}-{hi:g} us | {us / 1e3:.2f} | {n} |".replace("-inf us", "+ us")
              for lo, hi, us, n in s["by_length"]]
    lines += ["", "| idle by outermost host op | ms | host-bound ms | gaps |", "|---|---|---|---|"]
    lines += [f"| `{c[:90]}` | {us / 1e3:.2f} | {hb / 1e3:.2f} | {n} |" for c, us, hb, n in by_context(found)[:top]]
    lines += ["", f"The {top} largest gaps:", "",
              "| at ms | us | host-bound | launched by | kernel after | kernel before |", "|---|---|---|---|---|---|"]
    for g in sorted(found, key=lambda g: -g.us)[:top]:
        lines.append(f"| {g.start_us / 1e3:.2f} | {g.us:.0f} | {'yes' if g.host_bound else 'no'} | `{g.op[:60]}` "
                     f"| `{g.after[:50]}` | `{g.before[:50]}` |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz) of profiled steps")
    p.add_argument("--top", type=int, default=12, help="rows of each table")
    p.add_argument("--min-us", type=float, default=1.0, help="shorter gaps are not counted")
    a = p.parse_args(argv)
    for path in a.traces:
        summary, found = gaps(load(path), a.min_us)
        print("\n".join(report(path.name, summary, found, a.top)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
