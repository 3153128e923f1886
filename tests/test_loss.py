"""The chunked LM head + loss (fp8train/train/loss.py) against an FP64 reference and the plain HF path.

The reference and its first-order BF16 error bound are `reference_and_bound` of benchmarks/lm_head_loss.py
(the GPU benchmark checks every implementation with the same function); its docstring derives the bound:
rounding h, W and the logits to BF16 with FP32 accumulation gives |dz| <= (3u + K 2**-24) |h| |W|^T
(u = 2**-8), which bounds the loss, the softmax's and so the logits gradient's error, and through the two
gradient GEMMs (BF16 operands, BF16-rounded products) the errors of grad_h and grad_W elementwise. The
tests allow 1.25x the bound (second-order terms) plus 2**-20 of the largest reference value (FP32
exp/log and sums), check that the plain HF path meets the same bound, and that the bound is informative.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fp8train.train.loss import _bf16_gemm_in_fp32, _mm, count_targets, linear_cross_entropy, target_rows, use_loss
from fp8train.train.model import ModelConfig, build_model

from _benchmarks import load_benchmark

VOCAB = 320

bench = load_benchmark("lm_head_loss")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(tied: bool):
    torch.manual_seed(0)
    return build_model(ModelConfig(source="tiny-qwen2", vocab_size=VOCAB, tie_embeddings=tied))


def _batch(batch: int = 3, seq: int = 37, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100   # a masked prompt
    labels[1, 20:] = -100  # masked tail
    labels[2, 5:8] = -100  # a hole
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).expand(batch, -1)}


def _hidden(model, batch) -> torch.Tensor:
    """The decoder's final hidden states (FP32 under autocast, as in training), a fresh leaf."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    assert h.dtype == torch.float32
    return h.detach().requires_grad_()


def _reference(h, w, labels, n):
    return bench.reference_and_bound(h, w, labels, n, chunk=50)  # chunked like the GPU run


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    worst = ((got.double() - ref).abs() / bench.allowance(ref, bound)).max().item()
    assert worst <= 1.0, f"{what}: error reaches {worst:.2f}x the BF16 bound"


def _loss_within(loss: float, ref: float, bound: float, what: str) -> None:
    assert abs(loss - ref) <= bench.SLACK * bound + 2.0**-20 * ref, what


def _chunked(h, w, labels, n, **kw):
    loss = linear_cross_entropy(h, w, labels, n, **kw)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.item(), gh.reshape(-1, gh.shape[-1]), gw


def _plain(h, w, labels, n):
    """Today's HF path: BF16 head under autocast, then HF's ForCausalLMLoss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
        loss = ForCausalLMLoss(logits, labels, w.shape[0], num_items_in_batch=n)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.item(), gh.reshape(-1, gh.shape[-1]), gw


# ----------------------------------------------------------------------------------- the function


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [None, 32, 7])  # one chunk; 111 tokens = 3 x 32 + ragged 15; 16 x 7 - 1
def test_chunked_loss_and_gradients_within_bf16_bound_of_fp64(tied, chunk):
    model = _model(tied)
    batch = _batch()
    h, w = _hidden(model, batch), model.get_output_embeddings().weight
    assert (w is model.get_input_embeddings().weight) == tied
    n = int((batch["labels"][:, 1:] != -100).sum()) + 17  # the global batch's count: other micro-batches too
    ref_loss, ref_gh, ref_gw, (b_loss, b_gh, b_gw) = _reference(h, w, batch["labels"], n)
    # the bound is informative: well under the values it bounds
    assert b_loss < 1e-2 * ref_loss and b_gh.max() < 0.1 * ref_gh.abs().max() and b_gw.max() < 0.1 * ref_gw.abs().max()
    for name, (loss, gh, gw) in {"chunked": _chunked(h, w, batch["labels"], n, chunk_tokens=chunk),
                                 "plain HF": _plain(h, w, batch["labels"], n)}.items():
        _loss_within(loss, ref_loss, b_loss, name)
        _within(gh, ref_gh, b_gh, f"{name} grad hidden")
        _within(gw, ref_gw, b_gw, f"{name} grad weight")
        assert gw.dtype == torch.float32 and gh.dtype == torch.float32


# Where the CPU's BF16 GEMM is ATen's scalar loop (no AVX-512), the head's GEMMs run in FP32 on the BF16
# values: the same products and rounding, summed in another order, so a BF16 result can differ by one ulp
FP32_HEAD = _bf16_gemm_in_fp32(torch.device("cpu"))


def _same(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit for bit; with FP32_HEAD, within one BF16 ulp of the largest element (the sums' order)."""
    if not FP32_HEAD:
        return torch.equal(got, ref)
    return bool(((got - ref).abs() <= 2.0**-7 * ref.abs().max()).all())


def test_bf16_head_gemm_computed_in_fp32_rounds_as_the_bf16_gemm():
    """The FP32 route rounds once to BF16 like the BF16 GEMM: small K (exact sums in FP32) gives the same bits."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 16, generator=g).bfloat16()
    b = torch.randint(-4, 5, (16, 24), generator=g).bfloat16()  # small integers: every partial sum exact
    assert torch.equal(_mm(a, b), a.mm(b)) and _mm(a, b).dtype == torch.bfloat16
    assert torch.equal(_mm(a, b), (a.double() @ b.double()).bfloat16())


def test_one_chunk_is_the_plain_path_bit_for_bit_and_chunks_are_not():
    model = _model(True)
    batch = _batch()
    h, w = _hidden(model, batch), model.get_output_embeddings().weight
    n = (batch["labels"][:, 1:] != -100).sum()
    plain = _plain(h, w, batch["labels"], n)
    one = _chunked(h, w, batch["labels"], n)
    assert (one[0] == plain[0] or FP32_HEAD and one[0] == pytest.approx(plain[0], rel=1e-5))
    assert _same(one[1], plain[1]) and _same(one[2], plain[2])
    several = _chunked(h, w, batch["labels"], n, chunk_tokens=32)
    assert not torch.equal(several[2], plain[2])  # the weight gradient is summed over chunks in FP32


def test_upstream_gradient_scales_both_gradients_and_no_grad_gives_the_same_value():
    model = _model(False)
    batch = _batch()
    h, w = _hidden(model, batch), model.get_output_embeddings().weight
    loss = linear_cross_entropy(h, w, batch["labels"], 50, chunk_tokens=32)
    gh1, gw1 = torch.autograd.grad(loss, (h, w))
    loss3 = linear_cross_entropy(h, w, batch["labels"], 50, chunk_tokens=32)
    gh3, gw3 = torch.autograd.grad(loss3 * 3.0, (h, w))  # as the trainer's loss x world size
    torch.testing.assert_close(gh3, 3 * gh1, rtol=1e-6, atol=0)
    torch.testing.assert_close(gw3, 3 * gw1, rtol=1e-6, atol=0)
    with torch.no_grad():
        assert linear_cross_entropy(h, w, batch["labels"], 50, chunk_tokens=32).item() == loss.item()


def test_divisor_none_is_the_mean_over_targets_like_hf():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = _model(True)
    batch = _batch()
    h, w = _hidden(model, batch), model.get_output_embeddings().weight
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = ForCausalLMLoss(F.linear(h, w), batch["labels"], VOCAB).item()
        ours = linear_cross_entropy(h, w, batch["labels"], chunk_tokens=32).item()
    assert ours == pytest.approx(plain, rel=1e-6)


def test_compiled_chunk_arithmetic_within_bf16_bound_of_fp64():
    model = _model(False)
    batch = _batch()
    h, w = _hidden(model, batch), model.get_output_embeddings().weight
    n = int((batch["labels"][:, 1:] != -100).sum())
    ref_loss, ref_gh, ref_gw, (b_loss, b_gh, b_gw) = _reference(h, w, batch["labels"], n)
    loss, gh, gw = _chunked(h, w, batch["labels"], n, chunk_tokens=32, compile=True)
    _loss_within(loss, ref_loss, b_loss, "compiled")
    _within(gh, ref_gh, b_gh, "compiled grad hidden")
    _within(gw, ref_gw, b_gw, "compiled grad weight")


def _sft_batch(batch: int = 2, seq: int = 200, seed: int = 2) -> dict:
    """Rows of chats: most positions are prompt or padding (label -100), as in SFT."""
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    labels = torch.full_like(ids, -100)
    labels[0, 40:70] = ids[0, 40:70]      # an answer
    labels[0, 150:162] = ids[0, 150:162]  # a second chat's answer
    labels[1, 90:131] = ids[1, 90:131]
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).expand(batch, -1)}


def test_target_rows_names_the_rows_with_a_target_and_leaves_cpt_alone():
    labels = _sft_batch()["labels"]
    has_target = (F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).reshape(-1)  # HF's shift, written out
    rows, k = target_rows(labels), int(has_target.sum())
    assert k == 83 and rows.numel() == 128 and bool((rows[1:] > rows[:-1]).all())  # topped up to 2 x 64, in order
    assert int(count_targets(labels)) == k  # the loss's divisor counts the same targets
    assert set(has_target.nonzero().squeeze(1).tolist()) <= set(rows.tolist())
    extra = [r for r in rows.tolist() if not has_target[r]]
    assert extra == (~has_target).nonzero().squeeze(1)[:128 - k].tolist()  # the first rows without a target
    cpt = torch.randint(0, VOCAB, (3, 300))
    cpt[1, 100] = -100  # a document boundary
    assert target_rows(cpt) is None  # CPT: nearly every row has a target
    assert target_rows(torch.full((2, 300), -100)).numel() == 64  # no target at all: still a head to run
    assert target_rows(torch.full((1, 70), -100)) is None  # 64 rows would be more than 7/8 of them


@pytest.mark.parametrize("chunk", [None, 48])
def test_head_on_target_rows_only_gives_the_same_loss_and_gradients(chunk):
    """`rows`: the loss and both gradients are those of the whole batch, within the FP64 reference's BF16 bound;
    rows without a target get exactly zero gradient, as they do when the head runs on every row."""
    model = _model(False)
    batch = _sft_batch()
    h, w = _hidden(model, batch), model.get_output_embeddings().weight
    n = int((batch["labels"][:, 1:] != -100).sum())
    rows = target_rows(batch["labels"])
    ref_loss, ref_gh, ref_gw, (b_loss, b_gh, b_gw) = _reference(h, w, batch["labels"], n)
    loss, gh, gw = _chunked(h, w, batch["labels"], n, chunk_tokens=chunk, rows=rows)
    _loss_within(loss, ref_loss, b_loss, "target rows")
    _within(gh, ref_gh, b_gh, "target rows grad hidden")
    _within(gw, ref_gw, b_gw, "target rows grad weight")
    skipped = torch.ones(gh.shape[0], dtype=torch.bool)
    skipped[rows] = False
    assert skipped.sum() == 400 - 128 and not gh[skipped].any()
    every = _chunked(h, w, batch["labels"], n, chunk_tokens=chunk)
    assert loss == pytest.approx(every[0], rel=1e-6)
    assert _same(gh, every[1]) and not every[1][skipped].any()
    # the weight gradient sums the same products over fewer (all-zero) rows: the CPU's per-chunk BF16 product may
    # round the other way
    torch.testing.assert_close(gw, every[2], rtol=0, atol=2.0**-7 * every[2].abs().max().item())
    with torch.no_grad():  # evaluation
        assert linear_cross_entropy(h, w, batch["labels"], n, chunk_tokens=chunk, rows=rows).item() == loss


# -------------------------------------------------------------------------------------- the model


def _grads(model, batch, n):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch, num_items_in_batch=n)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_model_forward_uses_it_and_keeps_names_and_tied_weights(tied):
    base = _model(tied)
    batch = _batch()
    n = (batch["labels"][:, 1:] != -100).sum()
    plain_out, plain = _grads(copy.deepcopy(base), batch, n)
    assert plain_out.logits.shape == (3, 37, VOCAB)
    one_model, many_model = copy.deepcopy(base), copy.deepcopy(base)
    keys = list(one_model.state_dict())
    assert use_loss(one_model, "chunked") and use_loss(many_model, "chunked", chunk_tokens=32)  # take loss_rows
    assert list(one_model.state_dict()) == keys
    assert (one_model.lm_head.weight is one_model.model.embed_tokens.weight) == tied
    one_out, one = _grads(one_model, batch, n)
    assert one_out.logits is None  # never materialized
    assert one_out.loss.item() == pytest.approx(plain_out.loss.item(), rel=1e-5 if FP32_HEAD else 0)
    # embeddings (tied or not), head, every layer (FP32_HEAD: a head gradient one BF16 ulp off flows back)
    assert all(_same(one[k], plain[k]) for k in plain)
    many_out, many = _grads(many_model, batch, n)
    assert many_out.loss.item() == pytest.approx(plain_out.loss.item(), rel=1e-6)
    for k in plain:  # the head's BF16 rounding differs, and flows back through the layers
        torch.testing.assert_close(many[k], plain[k], rtol=0, atol=2.0**-7 * plain[k].abs().max().item())
    # without labels the plain forward runs (logits for generation and evaluation harnesses)
    with torch.no_grad():
        logits = one_model(input_ids=batch["input_ids"]).logits
    assert logits.shape == (3, 37, VOCAB)
    assert not use_loss(one_model, "hf")  # HF's own forward: no loss_rows
    assert "forward" not in vars(one_model)
    copied = copy.deepcopy(many_model)  # the bound forward follows the copy, not the original
    assert copied.forward.__self__ is copied


def test_use_loss_refuses_what_it_cannot_do():
    model = _model(True)
    with pytest.raises(ValueError, match="train.loss_impl"):
        use_loss(model, "fused")
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="train.loss_impl.*liger"):
            use_loss(model, "liger")
    biased = _model(False)
    biased.lm_head = torch.nn.Linear(128, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias-free nn.Linear"):
        use_loss(biased, "chunked")


def test_benchmark_runs_on_cpu_and_checks_against_hf(capsys):
    """benchmarks/lm_head_loss.py's harness (the GPU run's code) on a tiny shape: a ragged chunk too."""
    assert bench.main(["--device", "cpu", "--shapes", "70x64x320", "--impls", "hf", "chunked", "liger",
                       "--chunk-tokens", "auto", "32", "--reps", "1", "--warmup", "0"]) == 0
    table = capsys.readouterr().out.split("| tokens x hidden x vocab |")[1]
    rows = [line for line in table.splitlines() if line.startswith("| 70x64x320")]
    assert [r.split(" | ")[1:3] for r in rows] == [["hf", "-"], ["chunked", "70"], ["chunked", "32"]]  # no liger on CPU
    assert all(r.rstrip().endswith("| ok |") for r in rows)
