"""benchmarks/fidelity_layers.py's core functions on a tiny random Llama (no GGUF): the per-target loss error,
the layer-skipping shortcut it relies on, the swap-and-restore of the Linears, and the tile statistics on
tensors whose answers are worked out by hand. A few seconds on a CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fp8train import FP8Linear

from _benchmarks import load_benchmark

fl = load_benchmark("fidelity_layers")


@pytest.fixture(scope="module")
def model_and_ref():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, fl.reference(model, ids)


def test_no_fp8_is_exactly_zero_from_any_layer(model_and_ref):
    model, ref = model_and_ref
    assert len(ref.hidden) == 2
    for start in (0, 1):
        assert fl.evaluate(model, ref, start) == {"loss_rel_err": 0.0, "kl": 0.0}


def test_one_projection_in_fp8_changes_the_loss_and_is_put_back(model_and_ref):
    model, ref = model_and_ref
    original = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        before = model(input_ids=ref.ids).logits
    errors = {s: fl.loss_errors(model, {"b": ref}, (1, "down_proj"), r)["b"] for s, r in fl.recipes().items()}
    for e in errors.values():
        assert e["loss_rel_err"] != 0 and e["kl"] > 0
    assert errors["pow2"] != errors["exact"]  # the scale rule reaches the quantizer
    assert model.model.layers[1].mlp.down_proj is original
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ref.ids).logits, before)


def test_skipping_the_unchanged_layers_is_exact(model_and_ref):
    """FP8 in layer 1: starting from layer 1's recorded input gives the full forward's numbers bit for bit."""
    model, ref = model_and_ref
    recipe = fl.recipes()["pow2"]
    for target in ((1, "q_proj"), (1, None)):
        with fl.fp8_in(model, target, recipe):
            assert sum(isinstance(m, FP8Linear) for m in model.modules()) == (1 if target[1] else 7)
            assert fl.evaluate(model, ref, 1) == fl.evaluate(model, ref, 0)
    with fl.fp8_in(model, (None, None), recipe):
        assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 14
        everywhere = fl.evaluate(model, ref, 0)
    assert fl.loss_errors(model, {"b": ref}, (None, None), recipe)["b"] == everywhere
    assert fl.loss_errors(model, {"b": ref}, ((0, 1), None), recipe)["b"] == everywhere  # the same, as a layer set
    only_1 = fl.loss_errors(model, {"b": ref}, ((1,), None), recipe)["b"]  # layer 0 kept in BF16: starts at 1
    assert only_1 == fl.loss_errors(model, {"b": ref}, (1, None), recipe)["b"] != everywhere


def test_linear_inputs_are_what_the_model_feeds(model_and_ref):
    model, ref = model_and_ref
    x = fl.linear_inputs(model, ref.ids, {"0.q_proj", "0.o_proj"})
    assert x["0.q_proj"].shape == (2, 64, 128) and x["0.q_proj"].dtype == torch.float32  # RMSNorm of the FP32 stream
    assert x["0.o_proj"].dtype == torch.bfloat16  # the attention's output under autocast
    amax = fl.linear_inputs(model, ref.ids, reduce=lambda t: float(t.abs().max()))
    assert len(amax) == 14 and amax["0.q_proj"] == float(x["0.q_proj"].abs().max())
    stats = fl.operand_stats(model, {"b": ref.ids}, "1.gate_proj")
    assert set(stats) == {"weight", "input b"} and stats["weight"]["pow2"]["tiles"] == 2  # 256x128: 2 blocks
    err = stats["input b"]["output_rel_err"]
    assert err["control"] < 1e-3 < err["exact"] <= err["pow2"] < 0.1  # BF16 values: ~0; E4M3: a few percent


def test_tile_stats_of_an_outlier_tile():
    """Token 0 holds 448 (scale 1, pow2 or not), 63 values 0.01 (subnormal after scaling, kept: 5 x 2**-9) and 64
    values 1e-4 (below half of 2**-9: flushed); tokens 1 and 2 are all 1.0 (scaled to 256 or 448: normal)."""
    x = torch.ones(3, 128)
    x[0, 0], x[0, 1:64], x[0, 64:] = 448.0, 0.01, 1e-4
    for pow2 in (True, False):
        s = fl.tile_stats(x, (1, 128), pow2, seq=3)
        assert s["subnormal"] == pytest.approx(127 / 384) and s["flushed"] == pytest.approx(64 / 384)
        assert s["row_amax_spread"] == 448 and (s["outlier_tiles"], s["tiles"]) == (1, 3)
        assert s["max_abs"] == 448 and s["max_at"] == {"sequence": 0, "position": 0, "channel": 0}
        assert s["bf16_rel_err"] > 0 and 0 < s["rel_err"] < 0.01


def test_exact_scales_lift_values_out_of_the_subnormal_range():
    """amax 300: the pow2 scale rounds 300/448 up to 1, leaving 0.012 below 2**-6; the exact scale maps it to
    0.012 * 448/300 = 0.0179, a normal number."""
    x = torch.full((1, 128), 0.012)
    x[0, 5] = -300.0
    assert fl.tile_stats(x, (1, 128), True)["subnormal"] == pytest.approx(127 / 128)
    assert fl.tile_stats(x, (1, 128), False)["subnormal"] == 0
    assert fl.tile_stats(x, (1, 128), False)["max_at"] == {"row": 0, "col": 5}


def test_weight_blocks_with_a_ragged_edge():
    w = torch.full((256, 200), 0.5)
    w[130, 150] = 100.0  # block (1, 1), the ragged one (72 columns)
    amax = fl.tile_amax(w, (128, 128))
    assert amax.tolist() == [[0.5, 0.5], [0.5, 100.0]]
    s = fl.tile_stats(w, (128, 128), True)
    assert (s["outlier_tiles"], s["tiles"]) == (1, 4) and s["max_at"] == {"row": 130, "col": 150}
    # pow2 scale of the outlier block: 100/448 -> 0.25, so 0.5 scales to 2 (normal); nothing subnormal
    assert s["subnormal"] == 0 and s["flushed"] == 0


def test_report_tables(model_and_ref):
    model, ref = model_and_ref
    targets = [(None, None)] + [(i, p) for i in range(2) for p in (*fl.DECODER_PROJECTIONS, None)]
    res = {fl.key_of(t): {s: fl.loss_errors(model, {"b": ref}, t, r)
                          for s, r in fl.recipes(control=t[1] is None, operands=t[0] is None).items()} for t in targets}
    assert set(res["*.*"]) == {"pow2", "exact", "control", "weights only pow2", "inputs only pow2",
                               "weights only exact", "inputs only exact"}
    assert res["*.*"]["control"]["b"]["kl"] < res["*.*"]["pow2"]["b"]["kl"]
    assert all(fl.target_of(k) == t for k, t in zip(res, targets))
    table = fl.layer_table(res, 2, ["b"]).strip().splitlines()
    assert len(table) == 2 + 2 + 3 and table[-1].startswith("| all |  |")  # title, blank, head, rule, 2 layers, all
    assert len(table[2].split("|")) == 2 + 1 + 7 + 3
    assert len(fl.projection_table(res, 2, {"all": ["b"]}).strip().splitlines()) == 4 + 8  # + 7 projections, layer
    res["1.up_proj"]["control"] = fl.loss_errors(model, {"b": ref}, (1, "up_proj"), fl.recipes(True)["control"])
    stats = {"1.up_proj": fl.operand_stats(model, {"b": ref.ids}, "1.up_proj")}
    assert fl.stats_table(stats, res, ["b"]).count("| 1.up_proj: ") == 2  # weight and one input
