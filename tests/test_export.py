"""fp8train.export: BF16 and FP8-block exports of a tiny Qwen2, checked key by key and through transformers."""

import argparse
import importlib.util
import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fp8train.export import add_cli, export_checkpoint
from fp8train.fp8.quant import quantize

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_qwen2(path, intermediate=384, seed=0, tie=False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # heavier-tailed weights than init: blocks span many binades, as trained ones do
        for p in model.parameters():
            p.mul_(torch.exp(0.5 * torch.randn_like(p)))
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return model


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    src = root / "src"
    model = _tiny_qwen2(src)
    return {
        "root": root, "src": src, "model": model, "orig": _tensors(src),
        "hf": export_checkpoint(src, root / "hf", format="hf"),
        "fp8": export_checkpoint(src, root / "fp8", format="fp8-block"),
        "pow2": export_checkpoint(src, root / "pow2", format="fp8-block", pow2_scale=True),
    }


def _is_proj(key):
    return key.endswith(".weight") and key.split(".")[-2] in PROJ


def test_fp8_block_layout_key_by_key(exports):
    orig, out = exports["orig"], _tensors(exports["fp8"])
    expected = set()
    for key, w in orig.items():
        expected.add(key)
        if _is_proj(key):
            o, i = w.shape
            scale = out[key[: -len("weight")] + "weight_scale_inv"]
            expected.add(key[: -len("weight")] + "weight_scale_inv")
            assert out[key].dtype == torch.float8_e4m3fn and out[key].shape == w.shape
            assert scale.dtype == torch.float32 and scale.shape == (math.ceil(o / 128), math.ceil(i / 128))
        else:  # embeddings, lm_head, norms, biases: BF16, bit for bit the rounded originals
            assert out[key].dtype == torch.bfloat16
            assert torch.equal(out[key], w.to(torch.bfloat16)), key
    assert set(out) == expected
    assert sum(map(_is_proj, orig)) == 14  # 7 projections x 2 layers, all converted


def test_fp8_block_is_the_reference_quantization(exports):
    orig, out = exports["orig"], _tensors(exports["fp8"])
    for key in filter(_is_proj, orig):
        q = quantize(orig[key], block=(128, 128), fmt="e4m3", pow2_scale=False)
        assert torch.equal(out[key].view(torch.uint8), q.data.view(torch.uint8)), key
        assert torch.equal(out[key[:-6] + "weight_scale_inv"], q.scale), key


@pytest.mark.parametrize("which", ["fp8", "pow2"])
def test_dequantized_weights_within_e4m3_rounding(exports, which):
    """E4M3 keeps 3 mantissa bits, so round-to-nearest of v = w / s moves it by at most half a step:
    2^-4 |v| where v is normal (|v| >= 2^-6), 2^-10 (half the 2^-9 subnormal spacing) below that.
    Block scales keep |v| <= 448 (no clipping), so |w - fp8 * s| <= max(2^-4 |w|, 2^-10 s)."""
    orig, out = exports["orig"], _tensors(exports[which])
    worst = 0.0
    for key in filter(_is_proj, orig):
        w = orig[key].double()
        s = out[key[:-6] + "weight_scale_inv"].double()
        s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        err = (w - out[key].double() * s_full).abs()
        bound = torch.maximum(w.abs() * 2.0**-4, s_full * 2.0**-10) * (1 + 2.0**-20)  # fp32 w/s rounding
        assert (err <= bound).all(), key
        worst = max(worst, (err / bound).max().item())
        blocks = w.abs().reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128).amax(dim=(1, 3))
        assert (blocks / s <= 448 * (1 + 2.0**-20)).all()  # the scale covers the block amax (to fp32 rounding)
    assert worst > 0.5  # the bound is tight, not vacuous


def test_pow2_scales_are_powers_of_two(exports):
    exact, pow2 = _tensors(exports["fp8"]), _tensors(exports["pow2"])
    keys = [k for k in pow2 if k.endswith("weight_scale_inv")]
    for k in keys:
        mantissa, _ = torch.frexp(pow2[k])
        assert (mantissa == 0.5).all(), k
        assert (pow2[k] >= exact[k]).all()  # rounded up, never down
    assert any(not torch.equal(exact[k], pow2[k]) for k in keys)
    assert json.loads((exports["pow2"] / "config.json").read_text())["quantization_config"]["fp8train"]["pow2_scale"]


def test_fp8_block_config(exports):
    src = json.loads((exports["src"] / "config.json").read_text())
    cfg = json.loads((exports["fp8"] / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["activation_scheme"], q["weight_block_size"]) == ("fp8", "dynamic", [128, 128])
    assert q["modules_to_not_convert"] == ["lm_head"] == q["ignored_layers"]
    assert q["fp8train"]["converted_projections"] == sorted(PROJ) and q["fp8train"]["num_converted"] == 14
    assert cfg["dtype"] == "bfloat16"
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "model_type"):
        assert cfg[k] == src[k]
    assert "quantization_config" not in json.loads((exports["hf"] / "config.json").read_text())


def test_hf_export_is_bf16_and_loads(exports):
    from transformers import AutoModelForCausalLM

    orig, out = exports["orig"], _tensors(exports["hf"])
    assert set(out) == set(orig)
    for k, w in orig.items():
        assert torch.equal(out[k], w.to(torch.bfloat16)), k
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exports["hf"] / name).read_bytes() == (exports["src"] / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(exports["hf"])
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, out["model.layers.1.mlp.down_proj.weight"])


def test_sharded_export_with_index(exports, tmp_path):
    out = export_checkpoint(exports["src"], tmp_path / "sharded", format="fp8-block", max_shard_size="400KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            assert {k for k, v in index["weight_map"].items() if v == f.name} == set(h.keys())
    sharded, whole = _tensors(out), _tensors(exports["fp8"])
    assert set(sharded) == set(whole)
    assert all(torch.equal(sharded[k].view(torch.uint8), whole[k].view(torch.uint8)) for k in whole)
    # a sharded source is read through its index: re-exporting a sharded hf export changes nothing
    hf = export_checkpoint(exports["src"], tmp_path / "hf", format="hf", max_shard_size="400KB")
    again, ref = _tensors(export_checkpoint(hf, tmp_path / "again", format="hf")), _tensors(exports["hf"])
    assert set(again) == set(ref) and all(torch.equal(again[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="already quantized"):
        export_checkpoint(out, tmp_path / "twice", format="hf")


def test_transformers_loads_fp8_block_on_cpu(exports):
    """transformers dequantizes an fp8-block checkpoint on CPU (FineGrainedFP8Config(dequantize=True)):
    its Linear weights are fp8 * weight_scale_inv in BF16, bit for bit, so its logits equal a BF16 model
    holding our dequantized weights. Against the plain BF16 export the logits move by the FP8 weight
    error alone: 2^-4 relative at worst per weight, ~2-3% RMS; through the 7 projections of 2 random
    layers that is ~7% relative RMS of the logits (seeded, so stable), so 10% is the bound. Real weights
    and text are checked on the GPU (docs/export_eval.md)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    dequantize = FineGrainedFP8Config(dequantize=True)
    fp8 = AutoModelForCausalLM.from_pretrained(exports["fp8"], quantization_config=dequantize)
    ref = AutoModelForCausalLM.from_pretrained(exports["hf"])
    tensors = _tensors(exports["fp8"])
    with torch.no_grad():
        for key in filter(_is_proj, tensors):
            deq = (tensors[key].float() * tensors[key[:-6] + "weight_scale_inv"].repeat_interleave(128, 0)
                   .repeat_interleave(128, 1)).to(torch.bfloat16)
            assert torch.equal(fp8.get_parameter(key), deq), key
            ref.get_parameter(key).copy_(deq)
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
        got, same = fp8(ids).logits.float(), ref(ids).logits.float()
        bf16 = AutoModelForCausalLM.from_pretrained(exports["hf"])(ids).logits.float()
    assert torch.equal(got, same)
    rel = ((got - bf16).norm() / bf16.norm()).item()
    assert 0 < rel < 0.1


def test_unaligned_projection_group_stays_bf16(tmp_path):
    """down_proj [256, 320] is not whole 128x128 blocks, nor are gate/up [320, 256]: the MLP stays BF16
    (gate/up together, as servers fuse them) and is listed; attention is still converted. Tied
    embeddings (no lm_head.weight in the files) stay tied."""
    _tiny_qwen2(tmp_path / "src", intermediate=320, tie=True)
    out = export_checkpoint(tmp_path / "src", tmp_path / "fp8", format="fp8-block")
    t = _tensors(out)
    assert "lm_head.weight" not in t
    for layer in range(2):
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert t[f"model.layers.{layer}.mlp.{name}.weight"].dtype == torch.bfloat16
        assert t[f"model.layers.{layer}.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert skip == ["lm_head"] + sorted(f"model.layers.{i}.mlp.{n}" for i in range(2)
                                        for n in ("down_proj", "gate_proj", "up_proj"))
    if importlib.util.find_spec("accelerate"):
        from transformers import AutoModelForCausalLM, FineGrainedFP8Config

        model = AutoModelForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model.model.layers[0].mlp.down_proj.weight, t["model.layers.0.mlp.down_proj.weight"])


def _training_checkpoint(exports, root):
    from fp8train.train.checkpoint import save_checkpoint

    model = exports["model"]
    return save_checkpoint(root, 10, model=model, optimizer=torch.optim.AdamW(model.parameters()))


def test_training_checkpoint_dir_and_cli(exports, tmp_path):
    ckpt = _training_checkpoint(exports, tmp_path / "ckpts")
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["export", str(ckpt), "--format", "fp8-block", "-o", str(tmp_path / "o"), "--pow2-scale"])
    assert args.pow2_scale is True and args.func(args) == 0
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(_tensors(tmp_path / "o").values(), _tensors(exports["pow2"]).values()))
    assert not (tmp_path / "o" / "optimizer.pt").exists()
    assert parser.parse_args(["export", str(ckpt), "-o", "x"]).pow2_scale is False
    assert parser.parse_args(["export", str(ckpt), "-o", "x", "--no-pow2-scale"]).pow2_scale is False


def _flip_a_weight_byte(ckpt):
    f = ckpt / "model" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def test_export_and_eval_refuse_a_corrupted_checkpoint(exports, tmp_path, capsys):
    """issue 17: export (and eval) of a checkpoint verify it as resume does, and write nothing on refusal."""
    from fp8train.cli import main
    from fp8train.eval import EvalConfig, run_eval
    from fp8train.train.checkpoint import CorruptCheckpointError

    ckpt = _training_checkpoint(exports, tmp_path / "ckpts")
    _flip_a_weight_byte(ckpt)
    out = tmp_path / "new" / "out"
    with pytest.raises(CorruptCheckpointError, match=r"model/model.safetensors has sha256 [0-9a-f]{64}, manifest"):
        export_checkpoint(ckpt, out)
    capsys.readouterr()
    assert main(["export", str(ckpt), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors has sha256" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()  # no output directory, not even its parent
    data = tmp_path / "problems.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors has sha256"):
        run_eval(EvalConfig(model=str(ckpt), data=str(data), backend="hf", out=str(tmp_path / "eval")))
    assert not (tmp_path / "eval").exists()
    (ckpt / "manifest.json").unlink()  # a checkpoint directory without its manifest is incomplete
    with pytest.raises(CorruptCheckpointError, match="manifest.json is missing"):
        export_checkpoint(ckpt, out)


def test_outputs_follow_the_umask(exports, tmp_path):
    """issue 17: checkpoints and exports are readable by others under the usual umask (not mkdtemp's 0700)."""
    import os

    from fp8train.export import export_hf

    old = os.umask(0o022)
    try:
        written = [_training_checkpoint(exports, tmp_path / "ckpts"), export_checkpoint(exports["src"], tmp_path / "e"),
                   export_hf(exports["model"], tmp_path / "hf")]
    finally:
        os.umask(old)
    for root in written:
        for p in [root, *root.rglob("*")]:
            mode = p.stat().st_mode & 0o777
            assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


def test_bad_input_and_atomic_write(exports, tmp_path, monkeypatch):
    import fp8train.export as export

    with pytest.raises(FileNotFoundError, match="neither a Hugging Face model directory"):
        export_checkpoint(tmp_path, tmp_path / "o")
    with pytest.raises(ValueError, match="unknown format"):
        export_checkpoint(exports["src"], tmp_path / "o", format="fp8")
    with pytest.raises(FileExistsError, match="not empty"):
        export_checkpoint(exports["src"], exports["hf"])
    (tmp_path / "nosafetensors").mkdir()
    (tmp_path / "nosafetensors" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        export_checkpoint(tmp_path / "nosafetensors", tmp_path / "o")

    def crash(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "_write_config", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(exports["src"], tmp_path / "half")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nosafetensors"]  # no half export, no temp dir


def _list_in_manifest(ckpt, rel, drop=()):
    """Make the manifest of `ckpt` list `rel` with its true size and sha256 (and forget `drop`): what a
    forger who wrote every file of the checkpoint can do."""
    import hashlib

    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / rel).read_bytes()
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for gone in drop:
        del manifest["files"][gone]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _refused_in_one_line(argv, capsys, *expected):
    from fp8train.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and all(e in err for e in expected), err


def test_index_naming_a_file_outside_the_model_is_refused(exports, tmp_path, capsys):
    """A verified checkpoint whose (listed, correctly hashed) index maps tensors to a file outside its
    model/ folder: export and eval refuse it in one line naming the index and the entry, and read nothing."""
    from fp8train.train.checkpoint import verify_checkpoint

    ckpt = _training_checkpoint(exports, tmp_path / "ckpts")
    outside = tmp_path / "elsewhere" / "y.safetensors"
    outside.parent.mkdir()
    (ckpt / "model" / "model.safetensors").rename(outside)
    with safe_open(str(outside), framework="pt") as f:
        names = list(f.keys())
    index = ckpt / "model" / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {n: str(outside) for n in names}}))
    _list_in_manifest(ckpt, "model/model.safetensors.index.json", drop=["model/model.safetensors"])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # so that eval gets as far as the weights
        (ckpt / "model" / name).write_bytes((exports["src"] / name).read_bytes())
        _list_in_manifest(ckpt, f"model/{name}")
    verify_checkpoint(ckpt)  # the forgery passes the manifest check: the index itself must be checked
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"export: .*index.json: weight_map entry '{names[0]}' -> "
                                         rf"'{outside}' is not the name of a file directly inside .*model"):
        export_checkpoint(ckpt, out)
    _refused_in_one_line(["export", str(ckpt), "-o", str(out)], capsys, str(index), str(outside))
    data = tmp_path / "problems.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    _refused_in_one_line(["eval", str(ckpt), "--data", str(data), "--out", str(tmp_path / "eval")], capsys,
                         "eval: ", str(index), str(outside))
    assert not out.exists() and not (tmp_path / "eval").exists()

    # The same in a plain model directory, for a relative escape and for a name that is not a string.
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in exports["src"].iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    shard = "model-00001-of-00001.safetensors"
    (plain / "model.safetensors").rename(plain / shard)
    for bad, shown in (("../model.safetensors", "'../model.safetensors'"), (1, "1"), ([shard], repr([shard]))):
        (plain / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard, "b": bad}}))
        with pytest.raises(ValueError, match=re.escape(f"weight_map entry 'b' -> {shown} is not the name of a file")):
            export_checkpoint(plain, out)
        _refused_in_one_line(["export", str(plain), "-o", str(out)], capsys, "export: ", shown)
        _refused_in_one_line(["eval", str(plain), "--data", str(data), "--out", str(tmp_path / "eval")], capsys,
                             "eval: ", shown)
    assert not out.exists() and not (tmp_path / "eval").exists()
    (plain / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    assert export_checkpoint(plain, out) == out  # a plain file name in the folder is read as before


@pytest.mark.parametrize("config, expected", [("{bad", "is not valid JSON"),
                                              ("[1, 2]", "holds a JSON list, not an object")])
def test_malformed_config_is_refused_before_any_work(exports, tmp_path, monkeypatch, capsys, config, expected):
    import fp8train.export as export

    src = tmp_path / "src"
    src.mkdir()
    for f in exports["src"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "config.json").write_text(config)
    monkeypatch.setattr(export, "_convert", lambda *a: pytest.fail("converted before reading config.json"))
    with pytest.raises(ValueError, match=rf"export: {re.escape(str(src / 'config.json'))} {expected}"):
        export_checkpoint(src, tmp_path / "o")
    _refused_in_one_line(["export", str(src), "-o", str(tmp_path / "o")], capsys, str(src / "config.json"), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_max_shard_size_in_bytes_and_non_positive_refused(exports, tmp_path, monkeypatch, capsys):
    import fp8train.export as export

    out = export_checkpoint(exports["src"], tmp_path / "bytes", format="hf", max_shard_size="400000")
    assert len(list(out.glob("*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()
    ref = _tensors(exports["hf"])
    assert all(torch.equal(t, ref[k]) for k, t in _tensors(out).items()) and len(_tensors(out)) == len(ref)
    assert export._shard_size("400KB") == export._shard_size(400000) == 400000
    assert export._shard_size("1.5 gb") == 1_500_000_000 and export._shard_size("9" * 30) == int("9" * 30)
    monkeypatch.setattr(export, "_convert", lambda *a: pytest.fail("converted before checking --max-shard-size"))
    for bad in ("0", "0GB", "0.0001KB", "-1", 0, "5 GiB", "1e9", ""):
        with pytest.raises(ValueError, match=r"--max-shard-size .*: expected a positive size"):
            export_checkpoint(exports["src"], tmp_path / "o", max_shard_size=bad)
    _refused_in_one_line(["export", str(exports["src"]), "-o", str(tmp_path / "o"), "--max-shard-size", "0"], capsys,
                         "--max-shard-size '0'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bytes"]
