"""convert_to_fp8 on tiny Hugging Face Qwen2 and Llama models."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fp8train import FP8Linear, convert_to_fp8, summarize_fp8_health, track_fp8_health

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(arch="qwen2", tied=False, seed=0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kw))
    return LlamaForCausalLM(LlamaConfig(**kw))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_converts_projections_and_keeps_parameters(arch):
    model = tiny(arch)
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters())
    report = convert_to_fp8(model, "hybrid")
    assert len(report.converted) == 2 * len(PROJ)
    assert all(n.rsplit(".", 1)[-1] in PROJ for n in report.converted)
    assert report.skipped == {"lm_head": "LM head stays BF16"}
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP8Linear)
    assert type(model.lm_head) is torch.nn.Linear
    after = dict(model.named_parameters())
    assert after.keys() == params_before.keys()
    assert all(after[n] is params_before[n] for n in after)  # the optimizer still holds the live params
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in after.values()}
    assert "14 Linear layers in FP8" in str(report)


def test_state_dict_round_trips_between_converted_and_plain():
    fp8 = tiny(seed=1)
    convert_to_fp8(fp8)
    plain = tiny(seed=2)
    plain.load_state_dict(fp8.state_dict())
    back = tiny(seed=3)
    convert_to_fp8(back)
    back.load_state_dict(plain.state_dict())
    for (n, a), (_, b) in zip(fp8.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_filter_shapes_and_bf16_recipe():
    model = tiny()
    report = convert_to_fp8(model, "hybrid", module_filter_fn=lambda m, fqn: "mlp" in fqn)
    assert len(report.converted) == 6 and report.skipped["model.layers.0.self_attn.q_proj"] == "not selected by the filter"
    odd = torch.nn.Sequential(torch.nn.Linear(100, 64))
    rep = convert_to_fp8(odd, "hybrid", module_filter_fn=lambda m, fqn: True)
    assert rep.converted == [] and rep.skipped == {"0": "dims not multiples of 16"}
    model = tiny()
    assert convert_to_fp8(model, "bf16").converted == []
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        convert_to_fp8(tiny(), "int4")


def test_recipe_specs():
    """`name+modifier...`: the spelling of bench variants and fidelity arms, one table (recipe.MODIFIERS)."""
    from dataclasses import replace

    from fp8train import make_recipe, parse_recipe

    assert parse_recipe("hybrid") == make_recipe("hybrid")
    assert parse_recipe("hybrid+exact+deep_gemm") == make_recipe("hybrid", pow2_scale=False, deep_gemm=True)
    assert parse_recipe("tensorwise+fused").fuse_swiglu and not parse_recipe("hybrid+unfused").fuse_swiglu
    assert parse_recipe("hybrid+wgrad_from_fp8") == replace(make_recipe("hybrid"), wgrad_input_from_fp8=True)
    assert parse_recipe("hybrid+fuse_rows").fuse_row_quantization and not make_recipe("hybrid").fuse_row_quantization
    assert make_recipe("hybrid", fuse_row_quantization=True).spec == "hybrid+fuse_rows"
    from fp8train.fp8.operands import LinearPlan  # the flag reaches the cuBLAS route's plan only (and its key)
    plans = LinearPlan.per_route(parse_recipe("hybrid+fuse_rows"))
    assert plans[True].fuse_rows and not plans[False].fuse_rows
    with pytest.raises(ValueError, match="fuse_row_quantization needs power-of-two scales"):
        parse_recipe("hybrid+exact+fuse_rows")  # an exact scale divides, approximately in inductor's code
    assert LinearPlan.parse(plans[True].key) == plans[True] and plans[True].key != LinearPlan.of(make_recipe(), True).key
    for spec in ("hybrid", "hybrid+exact+deep_gemm", "hybrid+wgrad_blocks+unfused", "tensorwise+fused", "bf16",
                 "hybrid+deep_gemm+fuse_rows"):
        assert parse_recipe(spec).spec == spec and parse_recipe(parse_recipe(spec).spec) == parse_recipe(spec)
    assert make_recipe("hybrid", fuse_swiglu=True).spec == "hybrid"  # the named recipe's own value: no modifier
    with pytest.raises(ValueError, match="recipe 'hybrid.fast': unknown modifier 'fast'"):
        parse_recipe("hybrid+fast")
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        parse_recipe("int4+exact")


def test_siblings_share_one_input_quantization():
    model = tiny()
    convert_to_fp8(model)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj._input_cache is attn.k_proj._input_cache is model.model.layers[1].mlp.up_proj._input_cache
    x = torch.randn(2, 8, 128)
    attn.q_proj(x)
    entry = attn.q_proj._input_cache[x]
    attn.k_proj(x)
    attn.v_proj(x)
    assert attn.v_proj._input_cache[x] is entry and len(attn.q_proj._input_cache) == 1
    del x, entry
    assert len(attn.q_proj._input_cache) == 0  # entries die with their tensor


@pytest.mark.parametrize("recipe", ["hybrid", "bf16"])
def test_a_few_steps_lower_the_loss(recipe):
    model = tiny(seed=4)
    convert_to_fp8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (4, 64), generator=g)
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses


def test_fp8_and_bf16_losses_track_each_other():
    losses = {}
    for recipe in ("hybrid", "bf16"):
        model = tiny(seed=5)
        convert_to_fp8(model, recipe)
        ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", torch.bfloat16):
            losses[recipe] = float(model(input_ids=ids, labels=ids).loss)
    assert abs(losses["hybrid"] - losses["bf16"]) / losses["bf16"] < 0.01, losses


def test_health_tracking():
    model = tiny()
    convert_to_fp8(model)
    ids = torch.randint(0, 512, (2, 32))
    with track_fp8_health(model) as stats:
        model(input_ids=ids, labels=ids).loss.backward()
    assert len(stats) == 14
    for roles in stats.values():
        assert set(roles) == {"input", "weight", "grad_output"}
        for s in roles.values():
            assert 0 <= s["underflow"] <= 1 and 0 <= s["saturation"] <= 1 and 0 < s["scale_min"] <= s["scale_max"]
    # tiny initial weights (std 0.02) flush a visible share of values in their 128x128 blocks
    assert any(r["weight"]["underflow"] > 0 for r in stats.values())
    summary = summarize_fp8_health(stats)
    assert set(summary) == set(PROJ) and set(summary["q_proj"]) == {"input", "weight", "grad_output"}
    model(input_ids=ids)  # outside the context nothing is recorded any more
    assert not any(m.tracking_health for m in model.modules() if isinstance(m, FP8Linear))


def test_fused_adamw_updates_are_seen_by_fp8_layers():
    """Regression: fused AdamW updates weights without bumping their version counter; a weight cache
    keyed on it trained with stale FP8 weights (seen on the GPU). The model must always compute with
    the current weights: its loss equals that of a fresh conversion of the same state_dict."""
    from fp8train import cache_fp8_weights

    model = tiny(seed=6)
    convert_to_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        with cache_fp8_weights(model):
            for half in ids.split(1):  # two micro-batches share one weight quantization
                model(input_ids=half, labels=half).loss.backward()
        opt.step()
        opt.zero_grad()
    fresh = tiny(seed=7)
    fresh.load_state_dict(model.state_dict())
    convert_to_fp8(fresh)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids).loss, fresh(input_ids=ids, labels=ids).loss)


def test_bf16_layers_keep_whole_decoder_layers_out_of_fp8():
    """`bf16_layers` (the first and last k layers of issue 19's knob): those layers' seven projections stay
    nn.Linear, the others convert, the report says why; an index outside the model is an error naming it."""
    from fp8train.train.model import ModelConfig, build_model

    model = build_model(ModelConfig(source="tiny-qwen2", vocab_size=512, num_layers=4))
    report = convert_to_fp8(model, "hybrid", bf16_layers=[0, -1])
    kinds = {i: {type(m) for n, m in model.model.layers[i].named_modules() if n.rsplit(".", 1)[-1] in PROJ}
             for i in range(4)}
    assert kinds[0] == kinds[3] == {torch.nn.Linear} and kinds[1] == kinds[2] == {FP8Linear}
    assert len(report.converted) == 14 and "bf16_layers: decoder layers [0, 3]" in str(report)
    with pytest.raises(ValueError, match="bf16_layers: 4 is not a decoder layer index of a 4-layer model"):
        convert_to_fp8(build_model(ModelConfig(source="tiny-qwen2", vocab_size=512, num_layers=4)), bf16_layers=[4])
