"""FP8Linear under torch.compile: one graph per decoder layer, the same numbers as eager, shared quantization.

The FP8 pieces are custom ops (fp8train.fp8.ops); `torch.library.opcheck` checks their fake (shape-only)
implementations against the real ones, which is what makes a compiled graph's buffers right.
"""

import collections
import operator

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor

from fp8train import compile_options, convert_to_fp8
from fp8train.fp8 import ops as _fp8_ops
from fp8train.fp8.operands import LinearPlan, OperandSpec
from fp8train.train.model import ModelConfig, build_model, decoder_layers
from fp8train.fp8.recipe import make_recipe


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _plans(recipe):
    """The emulated plan, and the cuBLAS plan's padding with emulated GEMMs (the cuBLAS layouts on a CPU)."""
    from dataclasses import replace

    r = make_recipe(recipe)
    return [LinearPlan.of(r, False), replace(LinearPlan.of(r, True), cublas=False)]


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise"])
def test_custom_ops_fake_implementations_match(recipe):
    """Schema, aliasing and fake-vs-real shapes/strides/dtypes of the three ops, with ragged shapes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 384, generator=g).bfloat16()
    w = torch.randn(256, 384, generator=g)
    dy = torch.randn(200, 256, generator=g).bfloat16()
    fp8_in = ("test_faketensor", "test_aot_dispatch_dynamic")  # test_schema compares FP8 inputs: no CPU kernel
    for plan in _plans(recipe):
        for make_cols, make_rows in ((True, True), (False, True), (True, False)):
            torch.library.opcheck(_fp8_ops._quantize_input_op, (x, plan.key, make_cols, make_rows))
        xr, xr_s, xc, xc_s = _fp8_ops._quantize_input_op(x, plan.key, True, True)
        wq, wq_s = _fp8_ops.quantize_weight(w, plan.w, plan.pow2, False, plan.cublas)
        w_t = _fp8_ops.transpose_weight(wq, wq_s, plan, 384) or (None, None)  # a frozen weight's kept W.T
        for w_op, w_t_op in (((None, None), (None, None)), ((wq, wq_s), (None, None)), ((wq, wq_s), w_t)):
            torch.library.opcheck(_fp8_ops._forward_op, (xr, xr_s, w, *w_op, plan.key, torch.bfloat16),
                                  test_utils=fp8_in)
            for want_dx, want_dw in ((True, True), (True, False), (False, True)):
                saved = (xc, xc_s) if want_dw else (None, None)
                torch.library.opcheck(_fp8_ops._backward_op, (dy, w, *w_op, *w_t_op, *saved, plan.key, want_dx,
                                                              want_dw, torch.bfloat16), test_utils=fp8_in)


def test_ops_never_return_an_input_or_one_storage_twice():
    """A high-precision (bf16) operand of a BF16 input is a copy of the input; a per-tensor scale is not shared."""
    x = torch.randn(64, 128).bfloat16()
    hp = OperandSpec(None, None)
    plan = LinearPlan(hp, hp, hp, hp, hp, hp, pow2=True, cublas=False, x_t_from_fp8=False)
    out = _fp8_ops._quantize_input_op(x, plan.key, True, True)
    assert torch.equal(out[0], x) and out[0].data_ptr() != x.data_ptr()
    out = _fp8_ops._quantize_input_op(x, _plans("tensorwise")[0].key, True, True)
    assert torch.equal(out[1], out[3]) and out[1].data_ptr() != out[3].data_ptr()


def _count_real_calls(monkeypatch):
    """Counts of the quantization/GEMM implementations run on real tensors (not the fake shape passes)."""
    calls = collections.Counter()
    for name in ("_quantize_activation", "quantize_weight", "gemm"):
        real = getattr(_fp8_ops, name)

        def wrapped(*args, _real=real, _name=name):
            if not isinstance(args[0], FakeTensor):
                calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(_fp8_ops, name, wrapped)
    return calls


def _tiny_model(recipe="hybrid"):
    torch.manual_seed(0)
    model = build_model(ModelConfig(source="tiny-qwen2", vocab_size=256))
    convert_to_fp8(model, recipe)
    return model


def _step(model, layer_fn, ids):
    """Forward + backward of the first decoder layer (through layer_fn) on the embedded tokens."""
    model.zero_grad(set_to_none=True)
    layer = decoder_layers(model)[0]
    h = model.model.embed_tokens(ids).detach().requires_grad_()
    pos = torch.arange(ids.shape[1])[None]
    cos_sin = model.model.rotary_emb(h, pos)
    with torch.autocast("cpu", torch.bfloat16):
        out = layer_fn(h, position_embeddings=cos_sin, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), h.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def test_compiled_decoder_layer_is_one_graph_with_eager_numbers(monkeypatch):
    """No graph break at the FP8 Linears; forward and backward equal eager bit for bit (aot_eager keeps
    the surrounding ops' arithmetic, so any difference would be the FP8 path's); q/k/v and gate/up share
    one quantization of their input compiled (CSE) as eagerly (input cache): the same kernel count."""
    model = _tiny_model()
    layer = decoder_layers(model)[0]
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    calls = _count_real_calls(monkeypatch)
    ref = _step(model, layer, ids)
    eager_calls = dict(calls)
    pos = torch.arange(96)[None]
    h = model.model.embed_tokens(ids)
    explain = torch._dynamo.explain(layer)(h, position_embeddings=model.model.rotary_emb(h, pos), position_ids=pos)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    _step(model, compiled, ids)  # compiles
    calls.clear()
    got = _step(model, compiled, ids)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    # per layer: 4 input quantizations (q/k/v shared, o, gate/up shared, down) + 7 grad_output ones
    assert eager_calls["_quantize_activation"] == 11 and dict(calls) == eager_calls, (dict(calls), eager_calls)


def test_compiled_with_changing_sequence_lengths(monkeypatch):
    """A new length recompiles with a dynamic token dimension (the fake implementations take symbolic
    sizes); every length still gives eager's numbers."""
    model = _tiny_model()
    layer = decoder_layers(model)[0]
    compiled = torch.compile(layer, backend="aot_eager")
    for n in (64, 200, 130):
        ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
        ref = _step(model, layer, ids)
        got = _step(model, compiled, ids)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), n


def test_health_tracking_under_compile_keeps_the_graph_and_the_numbers():
    """Tracking only observes: the compiled layer stays one graph and computes eager's numbers bit for bit,
    and the statistics equal the eager ones."""
    from fp8train import track_fp8_health

    model = _tiny_model()
    layer = decoder_layers(model)[0]
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    ref = _step(model, layer, ids)
    with track_fp8_health(model) as eager_stats:
        tracked = _step(model, layer, ids)
    assert all(torch.equal(a, b) for a, b in zip(tracked, ref))
    pos = torch.arange(64)[None]
    h = model.model.embed_tokens(ids)
    with track_fp8_health(model):
        explain = torch._dynamo.explain(layer)(h, position_embeddings=model.model.rotary_emb(h, pos), position_ids=pos)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    with track_fp8_health(model) as stats:
        got = _step(model, compiled, ids)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert stats == eager_stats and len(stats) == 7
    first = stats["model.layers.0.self_attn.q_proj"]
    assert set(first) == {"input", "weight", "grad_output"} and 0 <= first["input"]["underflow"] < 0.1
    assert first["weight"]["underflow"] > 0  # std-0.02 init: small values in 128x128 blocks flush to zero


def test_inductor_compiled_model_trains_like_eager():
    """The real compiler on CPU (C++ codegen around the FP8 ops): losses of a few AdamW steps agree with
    eager to BF16 rounding (inductor fuses the BF16 elementwise ops, which changes their last bits)."""
    losses = {}
    for mode in ("eager", "inductor"):
        torch._dynamo.reset()
        model = _tiny_model()
        if mode == "inductor":
            for layer in decoder_layers(model):
                layer.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
        losses[mode] = []
        for _ in range(4):
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[mode].append(float(loss))
    assert losses["eager"][-1] < losses["eager"][0] - 0.1  # it trains
    for a, b in zip(losses["inductor"], losses["eager"]):
        assert abs(a - b) < 2e-2 * abs(b), losses


def _kernel_graph(kernels, reads, clone_inputs=False):
    """A graph of functional Triton kernel nodes: node i runs kernels[i] on its own view of placeholder
    reads[i] (as each Linear views its input), with M=64 as its constant and one fresh output buffer; the
    output returns every node's buffer. clone_inputs: list the input in tensors_to_clone as well, as
    torch 2.11's mutation analysis does."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

    g = torch.fx.Graph()
    xs = {name: g.placeholder(name) for name in sorted(set(reads))}
    outs = []
    for kernel, read in zip(kernels, reads):
        buf = g.call_function(torch.ops.aten.empty.memory_format, ([64, 128],), {"dtype": torch.float8_e4m3fn})
        buf.meta["val"] = torch.empty(64, 128, dtype=torch.float8_e4m3fn, device="meta")
        node = g.call_function(triton_kernel_wrapper_functional, (), {
            "kernel_idx": kernel_side_table.add_kernel(kernel),
            "constant_args_idx": kernel_side_table.add_constant_args({"M": 64}),
            "grid": [(1, 1, 1)], "tma_descriptor_metadata": {},
            "kwargs": {"x_ptr": g.call_function(torch.ops.aten.view.default, (xs[read], [64, 128])), "q_ptr": buf},
            "tensors_to_clone": ["x_ptr", "q_ptr"] if clone_inputs else ["q_ptr"]})
        outs.append(g.call_function(operator.getitem, (node, "q_ptr")))
    g.output(tuple(outs))
    return g


@pytest.mark.parametrize("clone_inputs", [False, True])
def test_share_quantization_pass_merges_only_our_kernels_on_the_same_input(clone_inputs):
    """The joint-graph pass of compile_options(): fp8train kernel nodes that read the same tensor with the
    same constants collapse to the first (q/k/v on one hidden state), though torch wraps each launch in
    its own Autotuner; another input, another launch config or a foreign kernel stays, and so does a kernel on another tensor of the same shape (two weights of one shape are not one),
    also when the inputs are listed as cloned; the merged node's buffer is gone and every output still has
    a producer."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    def ours():
        pass

    def theirs():
        pass

    class Kernel:  # a JITFunction's shape: the Python function in .fn; hashed by identity
        def __init__(self, fn):
            self.fn = fn

    class Autotuner(Kernel):  # what torch wraps each launch with num_warps= in: a new one per call
        def __init__(self, fn, num_warps):
            super().__init__(fn)
            self.configs = [f"num_warps: {num_warps}"]

    ours.__module__ = "fp8train.fp8.kernels"
    jit, theirs_k = Kernel(ours), Kernel(theirs)
    kernels = [Autotuner(jit, 8), Autotuner(jit, 8), Autotuner(jit, 8), Autotuner(jit, 8), Autotuner(jit, 4),
               theirs_k, theirs_k]
    g = _kernel_graph(kernels, ["h", "h", "h", "mlp", "h", "h", "h"], clone_inputs)
    compile_options()["joint_custom_pre_pass"](g)
    g.lint()
    kernels = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    reads = [(n.kwargs["kwargs"]["x_ptr"].args[0].name, n.kwargs["kernel_idx"]) for n in kernels]
    # q/k/v merged into one; the MLP input, the other launch config and both foreign ones kept
    assert len(kernels) == 5, reads
    assert sum(n.target is torch.ops.aten.empty.memory_format for n in g.nodes) == 5
    producers = [a.args[0] for a in next(n for n in g.nodes if n.op == "output").args[0]]
    assert producers[0] is producers[1] is producers[2] and producers[3] is not producers[0]
    assert producers[4] is not producers[0] and producers[5] is not producers[6]


def test_rows_traced_for_inductor_are_the_reference_quantization():
    """`fuse_row_quantization`'s traced rows (a cuBLAS plan's, compiled): on the CPU inductor compiles the same
    torch ops (the BF16 rounding's bitcast kept in the graph), and the rows and scales equal the reference's of the
    h the compiled kernel writes, bit for bit, in the op layout the GEMMs read (scales [blocks, tokens])."""
    from fp8train.fp8.operands import quantize_operand
    from fp8train.fp8.recipe import parse_recipe

    plan = LinearPlan.of(parse_recipe("hybrid+fuse_rows"), True)
    assert plan.fuse_rows and plan.x.pad == 512
    g, u = (torch.randn(64, 640, generator=torch.Generator().manual_seed(s)).bfloat16() * 8 for s in (0, 1))

    def fn(g, u):
        h = torch.nn.functional.silu(g) * u
        return h, *_fp8_ops.quantize_input(h, plan, False)

    h, q, s, cols, cols_scale = torch.compile(fn)(g, u)
    want_q, want_s = quantize_operand(h, plan.x, plan.pow2)
    assert q.shape == (64, 1024) and s.shape == (8, 64) and cols.numel() == 0 and cols_scale.numel() == 0
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert q.float().abs().max() > 100  # real values, not padding alone
