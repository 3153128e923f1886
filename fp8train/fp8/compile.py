"""An inductor joint-graph pass: one quantization per FP8 GEMM input, however many Linears read it.

q/k/v read one hidden state, gate/up another. On CUDA their input quantization traces to Triton kernel
nodes (`triton_kernel_wrapper_functional`) that AOTAutograd's CSE cannot merge: each launch gets its own
kernel index (torch wraps a launch with `num_warps=` in a new Autotuner), its own constant-args index and
its own `torch.empty` outputs. Unmerged, a layer quantizes its attention input three times and its MLP
input twice, and the partitioner saves every copy's FP8 columns for the backward. This pass merges Triton kernel nodes of fp8train's kernels that
read the same tensors with the same constants into the first one. It runs on the joint graph, before the
forward/backward partition, so the saved activations shrink as well; that is also before AOTAutograd's own
CSE, so each Linear still has its own `x.view(-1, K)` node: "the same tensor" is decided after following
identical pure ops to a common node.

`fp8train.compile_options()` hands it to torch.compile; the trainer compiles its decoder layers with it.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["ShareQuantization"]

_MODULE = "fp8train.fp8.kernels"


def _identity(kernel) -> tuple:
    """(the kernel's Python function, its launch configs). A launch with `num_warps=` is wrapped by
    torch in a fresh one-config Autotuner per call, so each call site gets its own kernel_idx: the
    wrappers are peeled off (Autotuner/Heuristics -> JITFunction -> function, each keeping the next in
    .fn) and only their configs kept."""
    configs = []
    while hasattr(kernel, "fn"):
        configs.append(tuple(str(c) for c in getattr(kernel, "configs", ())))
        kernel = kernel.fn
    return kernel, tuple(configs)


def _is_fresh(node) -> bool:
    """An uninitialized buffer (a kernel's output) rather than data the kernel reads. Missing one here
    only loses a merge: an unrecognized buffer counts by value, like data."""
    aten = torch.ops.aten
    return isinstance(node, torch.fx.Node) and node.target in (aten.empty.memory_format, aten.empty_strided.default)


def _pure(node: torch.fx.Node) -> bool:
    op = node.target
    return (node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and not op._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in op.tags and not _is_fresh(node) and not node.is_impure())


def _representatives(graph: torch.fx.Graph) -> dict:
    """node -> the first node computing the same value by the same pure ops on the same inputs."""
    rep: dict = {}
    seen: dict = {}
    for node in graph.nodes:
        rep[node] = node
        if not _pure(node):
            continue
        leaves, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
        sig = (node.target, str(spec), tuple(rep.get(v, v) if isinstance(v, torch.fx.Node) else v for v in leaves))
        try:
            rep[node] = seen.setdefault(sig, node)
        except TypeError:  # an unhashable argument (a symbolic size): leave the node alone
            pass
    return rep


def _key(node: torch.fx.Node, rep: dict):
    """What the kernel node computes: kernel, constants, grid and the tensors it reads; None for others'
    kernels. Fresh output buffers count by shape, stride and dtype only. Every other tensor counts by value
    (its representative), whether or not `tensors_to_clone` lists it (torch's mutation analysis lists any
    input it cannot prove read-only): two weights of one shape are not one weight."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kw = node.kwargs
    fn, configs = _identity(kernel_side_table.get_kernel(kw["kernel_idx"]))
    if getattr(fn, "__module__", None) != _MODULE:
        return None
    constants = kernel_side_table.get_constant_args(kw["constant_args_idx"])
    args = []
    for name, value in sorted(kw["kwargs"].items()):
        if _is_fresh(value):
            val = value.meta["val"]
            args.append((name, repr((tuple(val.shape), tuple(val.stride()), val.dtype))))
        else:
            args.append((name, rep[value] if isinstance(value, torch.fx.Node) else repr(value)))
    return (fn, configs, repr(sorted(constants.items())), repr(kw["grid"]),
            repr(kw["tma_descriptor_metadata"]), tuple(sorted(kw["tensors_to_clone"])), tuple(args))


class ShareQuantization(CustomGraphPass):
    """The pass: merge fp8train kernel nodes that compute the same thing into the first one."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

        kernels = [n for n in graph.nodes if n.op == "call_function" and n.target is triton_kernel_wrapper_functional]
        if not kernels:  # BF16 layers, CPU graphs: nothing to merge, no walk over the graph
            return
        rep = _representatives(graph)
        first: dict = {}
        for node in kernels:
            key = _key(node, rep)
            if key is None:
                continue
            kept = first.setdefault(key, node)
            if kept is node:
                continue
            # the kept node comes earlier and its inputs are this node's inputs, so it dominates our users
            buffers = [node.kwargs["kwargs"][name] for name in node.kwargs["tensors_to_clone"]]
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            for buf in buffers:
                if _is_fresh(buf) and not buf.users:
                    graph.erase_node(buf)

    def uuid(self) -> str:
        return "fp8train-share-quantization-4"
