"""The SwiGLU MLP converted whole (fp8/swiglu.py): the SwiGLU fused into its FP8 producers (`fuse_swiglu`)
and its inputs saved for backward as FP8 tiles (`swiglu_inputs_fp8`).

Fused, the MLP computes the three FP8Linears' numbers bit for bit on the CPU (forward, every gradient). With
FP8-saved inputs the forward is the Hugging Face module's bit for bit; the backward equals autograd's exactly
where the inputs are FP8-representable, and otherwise carries E4M3's rounding of g and u: measured against
FP64 here, between the BF16 path's accuracy and the FP8 GEMMs' own.
"""

import pytest
import torch
import torch.nn.functional as F

from fp8train import convert_to_fp8, make_recipe
from fp8train.fp8.operands import LinearPlan
from fp8train.fp8.swiglu import FP8SwiGLUMLP, _SwiGLUFn
from test_convert import tiny
from test_trainer import byte_tokenizer, corpus, one_thread  # noqa: F401 (fixtures)

SWIGLU = make_recipe("hybrid", swiglu_inputs_fp8=True, fuse_swiglu=False)
UNFUSED = make_recipe("hybrid", fuse_swiglu=False)
FUSED = make_recipe("hybrid")  # the default: fused


def _sqnr(x, ref):
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _grads(fn, g, u, dh):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = fn(g, u)
    h.backward(dh)
    return h.detach(), g.grad, u.grad


def test_exact_where_the_inputs_are_fp8_values():
    """g and u made of E4M3 values with 448 in every 1x128 tile (scale 1): the saved copies are exact, so
    h, grad_g and grad_u equal autograd's on silu(g) * u bit for bit."""
    torch.manual_seed(0)
    plan = LinearPlan.of(make_recipe("hybrid"), False)

    def fp8_values(rows, cols):
        bits = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x38  # no NaN (E4M3 has no inf)
        t = bits.view(torch.float8_e4m3fn).to(torch.bfloat16)
        t[:, ::128] = 448.0
        return t

    g, u = fp8_values(64, 384) / 64, fp8_values(64, 384)  # /64: a power of two, scale 2^-6 stays exact
    dh = torch.randn(64, 384).bfloat16()
    ref = _grads(lambda a, b: F.silu(a) * b, g, u, dh)
    got = _grads(lambda a, b: _SwiGLUFn.apply(a, b, plan), g, u, dh)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_gradients_against_fp64():
    """Random inputs with outlier tokens: the forward is exact; the gradients lose to the BF16 path by E4M3's
    rounding of g and u, and stay far above what an unrelated tensor scores (0 dB)."""
    torch.manual_seed(1)
    g, u = torch.randn(256, 512), torch.randn(256, 512)
    g[:3] *= 50
    dh = torch.randn(256, 512)
    plan = LinearPlan.of(make_recipe("hybrid"), False)
    g16, u16, dh16 = g.bfloat16(), u.bfloat16(), dh.bfloat16()
    ref = _grads(lambda a, b: F.silu(a) * b, g.double(), u.double(), dh.double())
    bf16 = _grads(lambda a, b: F.silu(a) * b, g16, u16, dh16)
    fp8 = _grads(lambda a, b: _SwiGLUFn.apply(a, b, plan), g16, u16, dh16)
    assert torch.equal(fp8[0], bf16[0])
    for i in (1, 2):
        s_bf16, s_fp8 = _sqnr(bf16[i], ref[i]), _sqnr(fp8[i], ref[i])
        assert s_bf16 > 40 and 24 < s_fp8 < s_bf16 - 10, (i, s_bf16, s_fp8)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_converted_model_same_forward_smaller_saved_tensors(arch):
    """convert_to_fp8 with the knob: every MLP becomes an FP8SwiGLUMLP under the same parameter names; the
    logits equal the plain conversion's bit for bit; the step saves 2 x tokens x intermediate bytes less per
    layer (g and u in FP8 instead of BF16); the gradients stay close to the plain conversion's."""
    plain, knob = tiny(arch), tiny(arch)
    convert_to_fp8(plain, UNFUSED)
    report = convert_to_fp8(knob, SWIGLU)
    assert report.swiglu_mlps == ["model.layers.0.mlp", "model.layers.1.mlp"] and "SwiGLU" in str(report)
    assert isinstance(knob.model.layers[0].mlp, FP8SwiGLUMLP) and "SwiGLU inputs saved in FP8" in repr(knob)
    assert plain.state_dict().keys() == knob.state_dict().keys()
    assert convert_to_fp8(knob, SWIGLU).swiglu_mlps == []  # converting again wraps nothing twice
    ids = torch.randint(0, 512, (2, 64))

    def step(model):
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), sum(saved), {n: p.grad for n, p in model.named_parameters()}

    lp, bytes_plain, gp = step(plain)
    lk, bytes_knob, gk = step(knob)
    assert torch.equal(lp, lk)
    tokens, inter, layers = ids.numel(), 256, 2
    saved_less = bytes_plain - bytes_knob
    # BF16 g and u (2 bytes each) -> FP8 (1 byte) + a scale per 128; the SiLU output autograd kept goes too
    assert saved_less >= layers * 2 * tokens * inter, (bytes_plain, bytes_knob)
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert _sqnr(gk[name], gp[name]) > 20, name


def test_compiled_matches_eager_and_trainer_key(tmp_path):
    """Compiled (the CPU's opaque quantization op), the layer computes eager's numbers."""
    model = tiny()
    convert_to_fp8(model, SWIGLU)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 32, 128)

    def run(fn):
        mlp.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = fn(xr)
        y.float().pow(2).sum().backward()
        return [y.detach(), xr.grad, mlp.gate_proj.weight.grad]

    ref = run(mlp)
    got = run(torch.compile(mlp, backend="aot_eager"))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_trainer_config_key(tmp_path, byte_tokenizer, corpus, capsys):
    """`swiglu_inputs_fp8: true` converts the MLPs, says so in the run's summary, and trains."""
    from fp8train.train.trainer import Trainer
    from test_trainer import tiny_config

    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, swiglu_inputs_fp8="true",
                      **{"train.steps": 10, "train.save_every": 0, "train.eval_every": 0})
    trainer = Trainer(cfg, progress=False)
    assert all(isinstance(layer.mlp, FP8SwiGLUMLP) for layer in trainer.model.model.layers)
    losses = trainer.fit().losses
    assert losses[10] < losses[1] - 0.5, losses
    # hybrid fuses the SwiGLU by default
    assert ("2 SwiGLU MLPs converted whole (SwiGLU fused into its FP8 producers, SwiGLU inputs saved in FP8)"
            in capsys.readouterr().out)


@pytest.mark.parametrize("fuse", ["true", "false"])
def test_with_lora_adapters(tmp_path, byte_tokenizer, corpus, fuse):
    """PEFT LoRA wraps the projections inside an FP8SwiGLUMLP (conversion first, then adapters; the MLP then
    runs its three Linears, fused or not): the adapters train and the frozen FP8 base stays unchanged."""
    pytest.importorskip("peft")
    from fp8train.train.trainer import Trainer
    from test_trainer import tiny_config

    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, swiglu_inputs_fp8="true", fuse_swiglu=fuse,
                      **{"model.lora.rank": 8, "optim.lr": 3e-3, "train.steps": 10, "train.save_every": 0,
                         "train.eval_every": 0})
    trainer = Trainer(cfg, progress=False)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    mlp = trainer.model.get_base_model().model.layers[0].mlp
    assert isinstance(mlp, FP8SwiGLUMLP) and hasattr(mlp.gate_proj, "lora_A")
    losses = trainer.fit().losses
    assert losses[10] < losses[1], losses
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)


# ------------------------------------------------------------------------------ fused (`fuse_swiglu`)

def _step(model, ids, compile_backend=None):
    fn = torch.compile(model, backend=compile_backend) if compile_backend else model
    with torch.autocast("cpu", torch.bfloat16):
        out = fn(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


@pytest.mark.parametrize("arch, recipe, fp8_inputs", [("qwen2", "hybrid", False), ("qwen2", "hybrid", True),
                                                      ("llama", "hybrid", False), ("llama", "hybrid", True),
                                                      ("qwen2", "tensorwise", False), ("qwen2", "rowwise", False),
                                                      ("qwen2", "hybrid+wgrad_blocks", False)])
def test_fused_mlp_is_the_three_linears_bit_for_bit(arch, recipe, fp8_inputs):
    """`fuse_swiglu` runs each MLP fused; on the CPU its logits and every parameter's gradient equal the three
    separate FP8Linears' exactly, with and without FP8-saved SwiGLU inputs, for every recipe."""
    from fp8train import parse_recipe

    plain, fused = tiny(arch), tiny(arch)
    convert_to_fp8(plain, make_recipe(parse_recipe(recipe), swiglu_inputs_fp8=fp8_inputs))
    report = convert_to_fp8(fused, make_recipe(parse_recipe(recipe), swiglu_inputs_fp8=fp8_inputs, fuse_swiglu=True))
    assert len(report.swiglu_mlps) == 2 and "SwiGLU fused into its FP8 producers" in str(report)
    assert plain.state_dict().keys() == fused.state_dict().keys()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3))
    (lp, gp), (lf, gf) = _step(plain, ids), _step(fused, ids)
    assert torch.equal(lp, lf)
    assert gp.keys() == gf.keys() and len(gp) == len(list(plain.parameters()))
    for name in gp:
        assert torch.equal(gp[name], gf[name]), name
    assert gf["model.layers.0.mlp.down_proj.weight"].abs().sum() > 0


def test_fused_mlp_compiled_equals_eager():
    """Compiled (the CPU's opaque ops; aot_eager keeps the rest eager's), the fused MLP computes eager's numbers;
    without grad it runs too (no input.T copies made)."""
    model = tiny()
    convert_to_fp8(model, FUSED)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(4))
    (le, ge), (lc, gc) = _step(model, ids), _step(model, ids, "aot_eager")
    assert torch.equal(le, lc) and all(torch.equal(ge[n], gc[n]) for n in ge)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model(input_ids=ids).logits, le)


def test_fused_mlp_frozen_gate_and_falls_back_where_it_must():
    """A frozen gate weight gets no gradient and the rest the unfused numbers; a layer tracking FP8 health
    makes the MLP run its three Linears (the health of each is recorded), as does a weight FSDP gathers in FP8."""
    plain, fused = tiny(), tiny()
    convert_to_fp8(plain, UNFUSED)
    convert_to_fp8(fused, FUSED)
    for m in (plain, fused):
        m.model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(5))
    (lp, gp), (lf, gf) = _step(plain, ids), _step(fused, ids)
    assert torch.equal(lp, lf) and gp.keys() == gf.keys()
    assert "model.layers.0.mlp.gate_proj.weight" not in gf
    assert all(torch.equal(gp[n], gf[n]) for n in gp)

    mlp = fused.model.layers[1].mlp
    assert mlp._fusable()
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.track_health(True)
    assert not mlp._fusable()
    _step(fused, ids)
    assert all(lin.health()["input"]["scale_max"] > 0 for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    other = tiny()
    convert_to_fp8(other, FUSED)
    mlp = other.model.layers[0].mlp
    assert mlp.gate_proj.prepare_fsdp(2, fp8_all_gather=True) is None and mlp.gate_proj.gathers_fp8
    assert not mlp._fusable()  # FSDP gathers the gate's weight as FP8 blocks: the three Linears run


def test_swiglu_grad_references_are_autograds():
    """`swiglu_grads_reference` (what the fused backward kernel computes) equals autograd's gradients of
    `swiglu_reference` bit for bit in BF16, outliers included."""
    from fp8train.fp8.ops import swiglu_grads_reference, swiglu_reference

    gen = torch.Generator().manual_seed(6)
    g, u, dh = (torch.randn(128, 384, generator=gen) * torch.logspace(-3, 3, 384) for _ in range(3))
    g, u, dh = g.bfloat16(), u.bfloat16(), dh.bfloat16()
    ref = _grads(swiglu_reference, g, u, dh)
    dg, du = swiglu_grads_reference(dh, g, u)
    assert torch.equal(dg, ref[1]) and torch.equal(du, ref[2])
    assert dg.dtype == du.dtype == torch.bfloat16 and dg.abs().sum() > 0


def test_trainer_fuse_swiglu_key_trains_the_same_run(tmp_path, byte_tokenizer, corpus, capsys):
    """`fuse_swiglu: true` in the trainer, with activation checkpointing (the Function's saved tensors are
    dropped and recomputed): the run summary says so and every step's loss equals the unfused run's exactly."""
    from fp8train.train.trainer import Trainer
    from test_trainer import tiny_config

    def losses(fuse):
        cfg = tiny_config(tmp_path / fuse, byte_tokenizer, corpus, fuse_swiglu=fuse,
                          **{"train.steps": 6, "train.save_every": 0, "train.eval_every": 0,
                             "train.activation_checkpointing": "true"})
        trainer = Trainer(cfg, progress=False)
        assert all(isinstance(layer.mlp, FP8SwiGLUMLP) == (fuse == "true") for layer in trainer.model.model.layers)
        return trainer.fit().losses

    fused, plain = losses("true"), losses("false")
    assert "2 SwiGLU MLPs converted whole (SwiGLU fused into its FP8 producers)" in capsys.readouterr().out
    assert fused == plain and fused[6] < fused[1], (fused, plain)


def test_fused_by_default_where_the_producer_kernels_exist(tmp_path, byte_tokenizer, corpus):
    """The hybrid recipe fuses the SwiGLU by default (its 1x128 tile kernels are the producers; measured
    faster on the H200); the tensor-wise and row-wise recipes do not; the trainer's `fuse_swiglu: null` (its
    default) takes the recipe's, and `false` keeps three FP8 Linears."""
    from fp8train.train.trainer import Trainer
    from test_trainer import tiny_config

    assert make_recipe("hybrid").fuse_swiglu and not make_recipe("hybrid", fuse_swiglu=False).fuse_swiglu
    assert not make_recipe("tensorwise").fuse_swiglu and not make_recipe("rowwise").fuse_swiglu
    for key, recipe, fused in ((None, "hybrid", True), ("false", "hybrid", False), (None, "tensorwise", False)):
        overrides = {"recipe": recipe, **({"fuse_swiglu": key} if key else {})}
        cfg = tiny_config(tmp_path / f"{recipe}-{key}", byte_tokenizer, corpus, **overrides)
        trainer = Trainer(cfg, progress=False)
        assert [isinstance(layer.mlp, FP8SwiGLUMLP) for layer in trainer.model.model.layers] == [fused] * 2, (key, recipe)


def test_converting_again_keeps_the_first_recipe():
    """A model converted already (`fp8train bench` converts variants with modifiers before the trainer does):
    a second conversion leaves its FP8Linears and their recipe alone, so an MLP converted unfused stays
    three Linears under a fusing recipe, and the summary says the layers arrived in FP8."""
    model = tiny()
    convert_to_fp8(model, UNFUSED)
    report = convert_to_fp8(model, FUSED)
    assert not report.converted and not report.swiglu_mlps
    assert not any(isinstance(m, FP8SwiGLUMLP) for m in model.modules())
    assert "0 Linear layers in FP8, 1 kept in BF16; 14 arrived as FP8Linear, left as they are" in str(report)


def _saved_bytes(model, ids) -> int:
    """Bytes one forward under BF16 autocast saves for backward (a count per saved tensor)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        model(input_ids=ids, labels=ids)
    return sum(sizes)


def test_fused_mlp_saves_less_for_backward_eagerly():
    """Eagerly autograd keeps silu(g) as well as g and u for the SwiGLU's backward (2 bytes per token and
    intermediate feature); the fused MLP keeps g and u only. (Compiled, inductor's partitioner already
    recomputes silu(g): no difference there.)"""
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(7))

    def saved_bytes(recipe):
        model = tiny()
        convert_to_fp8(model, recipe)
        return _saved_bytes(model, ids)

    tokens, inter, layers = ids.numel(), 256, 2
    assert saved_bytes(UNFUSED) - saved_bytes(FUSED) >= 2 * tokens * inter * layers


@pytest.mark.parametrize("recipe", ["hybrid", "hybrid+wgrad_from_fp8", "hybrid+swiglu_fp8", "tensorwise+fused",
                                    "hybrid+wgrad_blocks"])
def test_input_t_in_backward_same_numbers_less_saved(recipe):
    """`input_t_in_backward` makes the down projection's grad_weight operand in the backward from the saved g and u:
    logits and every gradient equal the forward-made operand's bit for bit, eagerly and compiled, and the
    forward saves 1 byte per token and intermediate feature and layer less (the FP8 h.T; eagerly the other
    Linears keep their FP8 input.T). Where g and u are saved in FP8, or h.T comes from h's FP8 rows
    (`wgrad_input_from_fp8`), the knob changes nothing."""
    from dataclasses import replace

    from fp8train import parse_recipe

    base = parse_recipe(recipe)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(8))
    runs, saved = {}, {}
    for later in (False, True):
        model = tiny()
        convert_to_fp8(model, replace(base, input_t_in_backward=later))
        runs[later] = _step(model, ids)
        runs[later, "compiled"] = _step(model, ids, "aot_eager")
        saved[later] = _saved_bytes(model, ids)
    for a, b in ((False, True), ((False, "compiled"), (True, "compiled"))):
        (la, ga), (lb, gb) = runs[a], runs[b]
        assert torch.equal(la, lb) and ga.keys() == gb.keys(), b
        assert all(torch.equal(ga[n], gb[n]) for n in ga), b
    tokens, inter, layers = ids.numel(), 256, 2
    if recipe in ("hybrid", "tensorwise+fused", "hybrid+wgrad_blocks"):
        assert saved[False] - saved[True] >= tokens * inter * layers, saved
    else:
        assert saved[False] == saved[True], saved


def test_input_t_in_backward_config_key(tmp_path, byte_tokenizer, corpus):
    """The trainer's `input_t_in_backward` reaches the recipe (null: the recipe's default) and is free to change on
    resume (the same numbers)."""
    from fp8train.train.resume import _FREE
    from fp8train.train.trainer import Trainer
    from test_trainer import tiny_config

    assert "input_t_in_backward" in _FREE
    for key, want in ((None, make_recipe("hybrid").input_t_in_backward), ("true", True), ("false", False)):
        cfg = tiny_config(tmp_path / str(key), byte_tokenizer, corpus, **({"input_t_in_backward": key} if key else {}))
        trainer = Trainer(cfg, progress=False)
        assert trainer.model.model.layers[0].mlp.recipe.input_t_in_backward is want, key


def test_wgrad_blocks_config_key(tmp_path, byte_tokenizer, corpus):
    """The trainer's `wgrad_blocks` puts every converted Linear's grad_weight input.T in 128x128 blocks (the recipe's
    `wgrad_blocks`); false keeps hybrid's token tiles; the bf16 arm of the same config converts nothing; changing it
    on resume changes the numbers, so it is not a free key."""
    from fp8train.fp8.recipe import BLOCK, TILE
    from fp8train.train.resume import _FREE
    from fp8train.train.trainer import Trainer
    from test_trainer import tiny_config

    assert "wgrad_blocks" not in _FREE
    for key, want in (("true", BLOCK), ("false", TILE)):
        trainer = Trainer(tiny_config(tmp_path / key, byte_tokenizer, corpus, wgrad_blocks=key), progress=False)
        layer = trainer.model.model.layers[0]
        assert layer.mlp.recipe.grad_weight.b.block == want and layer.self_attn.q_proj.recipe.grad_weight.b.block == want
        assert str(trainer.fp8_report).startswith(f"fp8train: recipe hybrid{'+wgrad_blocks' if key == 'true' else ''}:")
    trainer = Trainer(tiny_config(tmp_path / "bf16", byte_tokenizer, corpus, wgrad_blocks="true", recipe="bf16"),
                      progress=False)
    assert not trainer.fp8_report.converted


def test_input_t_in_backward_compiled_lets_the_partitioner_recompute():
    """Compiled by inductor (the trainer's per-layer compile), `input_t_in_backward` saves each Linear's input by
    reference and makes input.T in the backward; the partitioner recomputes the attention output (o_proj's input)
    rather than keep its FP8 copy, and keeps the norm outputs' FP8 copies (it does not recompute reductions): the
    forward saves 3 FP8 input.T copies and h.T per layer without the knob, 2 with it; the numbers are the same."""
    import torch._dynamo
    from dataclasses import replace

    from fp8train import compile_options

    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(9))
    runs, fp8 = {}, {}
    for later in (False, True):
        torch._dynamo.reset()
        model = tiny()
        convert_to_fp8(model, replace(FUSED, input_t_in_backward=later))
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, options=compile_options())
        saved = []

        def pack(t):
            saved.append(t.numel() if t.dtype == torch.float8_e4m3fn else 0)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            runs[later] = _step(model, ids)
        fp8[later] = sum(saved)
    (la, ga), (lb, gb) = runs[False], runs[True]
    assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    hidden, inter, tokens, layers = 128, 256, ids.numel(), 2  # input.T [K, tokens], h.T [I, tokens]
    assert fp8[False] == layers * (3 * hidden * tokens + inter * tokens), fp8
    assert fp8[True] == layers * 2 * hidden * tokens, fp8
