import copy
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from fp8train.export import export_hf
from fp8train.train import files as fs
from fp8train.train.checkpoint import (
    CorruptCheckpointError,
    capture_rng_state,
    find_latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from fp8train.train.optim import OptimConfig, build_optimizer, build_scheduler, clip_grad_norm

VOCAB = 1000


def _model(tied=True, seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg)


class _SubLinear(nn.Linear):
    """Stands in for FP8Linear: an nn.Linear subclass that shares the original's Parameters."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def _convert(model):
    layers = model.model.layers
    for name, module in list(layers.named_modules()):
        if type(module) is nn.Linear:
            parent, _, attr = name.rpartition(".")
            setattr(layers.get_submodule(parent), attr, _SubLinear(module))
    assert sum(isinstance(m, _SubLinear) for m in model.modules()) == 7 * len(layers)
    return model


def _setup(tied=True, seed=0, converted=False, layers=2):
    model = _model(tied, seed, layers)
    if converted:
        _convert(model)
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, schedule="wsd", warmup_steps=2, decay_steps=3)
    opt = build_optimizer(model, cfg)
    return model, opt, build_scheduler(opt, cfg, total_steps=10)


def _step(model, opt, sched):
    # Draws from all three RNGs, so the resumed run only matches if every one is restored.
    seq = random.randint(8, 16)
    shift = int(np.random.randint(0, 8))
    ids = torch.randint(0, VOCAB - 8, (2, seq)) + shift
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    clip_grad_norm(model, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _assert_state_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_state_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture
def seeded():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("tied, converted", [(True, False), (False, False), (True, True)],
                         ids=["tied", "untied", "tied-converted"])
def test_resume_is_bit_exact(tmp_path, seeded, tied, converted):
    model, opt, sched = _setup(tied, seed=0, converted=converted)
    for _ in range(2):
        _step(model, opt, sched)
    train_state = {"step": 2, "tokens": 64, "sampler": {"epoch": 0, "offset": 17, "order": torch.arange(5)}}
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched, train_state=train_state,
                           tokenizer=_tokenizer())
    assert path == tmp_path / "step_00000002" and find_latest_checkpoint(tmp_path) == path
    assert (path / "model" / "tokenizer.json").is_file()
    ref_losses = [_step(model, opt, sched) for _ in range(3)]

    # a fresh process: different init and RNG states, all of which the checkpoint must overwrite
    model2, opt2, sched2 = _setup(tied, seed=123, converted=converted)
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    state = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    _assert_state_equal(state, train_state)
    assert sched2.last_epoch == 2 and opt2.param_groups[0]["lr"] == 1e-2
    losses = [_step(model2, opt2, sched2) for _ in range(3)]

    assert [x.item() for x in losses] == [x.item() for x in ref_losses]  # bit for bit
    for x, y in zip(losses, ref_losses):
        assert torch.equal(x, y)
    _assert_state_equal(model2.state_dict(), model.state_dict(), "model")
    _assert_state_equal(opt2.state_dict(), opt.state_dict(), "optimizer")
    _assert_state_equal(sched2.state_dict(), sched.state_dict(), "scheduler")
    if tied:
        assert model2.lm_head.weight is model2.model.embed_tokens.weight


def test_checkpoint_model_dir_is_fp32_hf_directory(tmp_path):
    model, opt, sched = _setup(tied=False, converted=True)
    path = save_checkpoint(tmp_path, 0, model=model, optimizer=opt, scheduler=sched, train_state={})
    weights = load_file(path / "model" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    reloaded = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)
    _assert_state_equal(reloaded.state_dict(), model.state_dict(), "model")  # also: converted == original keys


def test_rng_capture_restore_all_generators(seeded):
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])


def test_train_state_must_be_plain(tmp_path):
    model, opt, sched = _setup()
    with pytest.raises(TypeError, match=r"train_state\['sampler'\]\['epoch'\] is a numpy.int64"):
        save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched,
                        train_state={"sampler": {"epoch": np.int64(1)}})
    assert find_latest_checkpoint(tmp_path) is None and not any(tmp_path.iterdir())


# --------------------------------------------------------------------------------------- torn / corrupt


@pytest.fixture
def saved(tmp_path):
    model, opt, sched = _setup()
    _step(model, opt, sched)
    first = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched, train_state={"step": 1})
    _step(model, opt, sched)
    second = save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched, train_state={"step": 2})
    return tmp_path, first, second


def _load_into_fresh(path):
    model, opt, sched = _setup(seed=7)
    return load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)


def test_missing_manifest_is_incomplete(saved):
    root, first, second = saved
    (second / "manifest.json").unlink()
    assert find_latest_checkpoint(root) == first
    with pytest.raises(CorruptCheckpointError, match=r"step_00000002/manifest.json is missing"):
        _load_into_fresh(second)
    assert _load_into_fresh(first) == {"step": 1}


def test_truncated_file_refused(saved):
    _, _, second = saved
    f = second / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"optimizer.pt has \d+ bytes, manifest.json says \d+"):
        _load_into_fresh(second)


def test_flipped_byte_refused_and_model_untouched(saved):
    _, _, second = saved
    f = second / "model" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    model, opt, sched = _setup(seed=7)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CorruptCheckpointError, match=r"model/model.safetensors has sha256 [0-9a-f]{64}"):
        load_checkpoint(second, model=model, optimizer=opt, scheduler=sched)
    _assert_state_equal(model.state_dict(), before, "model")  # verified before anything is loaded


@pytest.mark.parametrize("victim, match", [
    ("model/config.json", r"model/config.json is missing"),
    ("train_state.pt", r"train_state.pt is missing"),
])
def test_missing_file_refused(saved, victim, match):
    _, _, second = saved
    (second / victim).unlink()
    with pytest.raises(CorruptCheckpointError, match=match):
        _load_into_fresh(second)


def test_garbled_manifest_refused(saved):
    _, _, second = saved
    (second / "manifest.json").write_text('{"files": ')
    with pytest.raises(CorruptCheckpointError, match="manifest.json is unreadable"):
        _load_into_fresh(second)
    (second / "manifest.json").write_text(json.dumps({"format": "fp8train-checkpoint", "version": 1, "step": 2,
                                                      "files": {"optimizer.pt": {"size": 1, "sha256": "0" * 64}}}))
    with pytest.raises(CorruptCheckpointError, match="does not list model/config.json"):
        _load_into_fresh(second)


def test_leftover_temp_dir_ignored_then_cleaned(saved):
    root, first, second = saved
    # what kill -9 after the manifest but before the rename leaves: complete-looking, higher step
    shutil.copytree(second, root / ".tmp_step_00000009.abc123")
    (root / "step_00000007").mkdir()  # a step directory without a manifest
    assert find_latest_checkpoint(root) == second
    model, opt, sched = _setup()
    save_checkpoint(root, 3, model=model, optimizer=opt, scheduler=sched, train_state={})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002", "step_00000003",
                                                      "step_00000007"]
    assert find_latest_checkpoint(root) == root / "step_00000003"


def test_model_mismatch_names_keys(saved, tmp_path_factory):
    _, _, second = saved
    deeper, opt, sched = _setup(layers=3)
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.2.input_layernorm.weight'"):
        load_checkpoint(second, model=deeper)
    root = tmp_path_factory.mktemp("deep")
    path = save_checkpoint(root, 0, model=deeper, optimizer=opt, scheduler=sched, train_state={})
    with pytest.raises(ValueError, match=r"unexpected keys \['model.layers.2.input_layernorm.weight'"):
        load_checkpoint(path, model=_model())


def test_tied_untied_mismatch(tmp_path):
    untied, opt, sched = _setup(tied=False)
    path = save_checkpoint(tmp_path / "u", 0, model=untied, optimizer=opt, scheduler=sched, train_state={})
    with pytest.raises(ValueError, match=r"different values for 'model.embed_tokens.weight' and 'lm_head"):
        load_checkpoint(path, model=_model(tied=True))
    tied, opt, sched = _setup(tied=True)
    path = save_checkpoint(tmp_path / "t", 0, model=tied, optimizer=opt, scheduler=sched, train_state={})
    with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\]"):
        load_checkpoint(path, model=_model(tied=False))


# ------------------------------------------------------------------------------------ pruning / crashes


def test_keep_last(tmp_path):
    model, opt, sched = _setup()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model=model, optimizer=opt, scheduler=sched, train_state={"s": step},
                        keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    # a lower step saved after a higher one (a deliberate restart) is never pruned right away
    save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=sched, train_state={"s": 3}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000005"]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 6, model=model, optimizer=opt, scheduler=sched, train_state={}, keep_last=0)


def test_resave_same_step_replaces(saved):
    root, _, second = saved
    model, opt, sched = _setup(seed=3)
    save_checkpoint(root, 2, model=model, optimizer=opt, scheduler=sched, train_state={"step": "again"})
    assert _load_into_fresh(second) == {"step": "again"}
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


def _crash_on(monkeypatch, name):
    real = torch.save

    def torn_save(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        if str(f).endswith(name):
            with open(f, "r+b") as fh:  # half the file reached the disk, then the process died
                fh.truncate(os.path.getsize(f) // 2)
            raise OSError("simulated crash")

    monkeypatch.setattr(torch, "save", torn_save)


@pytest.mark.parametrize("crash", ["optimizer.pt", "train_state.pt", "rename"])
def test_crash_mid_save_keeps_previous_latest(saved, monkeypatch, crash):
    root, _, second = saved
    model, opt, sched = _setup(seed=5)
    if crash == "rename":  # everything written, manifest included, but never renamed into place
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("simulated crash")))
    else:
        _crash_on(monkeypatch, crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(root, 3, model=model, optimizer=opt, scheduler=sched, train_state={}, keep_last=1)
    monkeypatch.undo()
    assert find_latest_checkpoint(root) == second
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]  # nothing pruned
    assert _load_into_fresh(second) == {"step": 2}


# ------------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_hf_loads_with_transformers(tmp_path, seeded, tied):
    model, opt, sched = _setup(tied)
    for _ in range(2):
        _step(model, opt, sched)  # trained weights, not the init
    tok = _tokenizer()
    out = export_hf(model, tmp_path / "export", tokenizer=tok)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temp dirs left beside it

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    _assert_state_equal(loaded.state_dict(), expected, "exported")
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert len(load_file(out / "model.safetensors")) == len(expected) - tied  # tied alias stored once

    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits.float()
    scale = ref.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(got, ref, atol=2e-2 * scale, rtol=0)  # BF16 weights and compute
    assert AutoTokenizer.from_pretrained(out)("hello lazy fox").input_ids == tok("hello lazy fox").input_ids


def test_export_of_converted_model_matches_original(tmp_path):
    original = _model(tied=False)
    converted = _convert(copy.deepcopy(original))
    a = export_hf(original, tmp_path / "a")
    b = export_hf(converted, tmp_path / "b")
    _assert_state_equal(load_file(b / "model.safetensors"), load_file(a / "model.safetensors"), "weights")
    config = [json.loads((d / "config.json").read_text()) for d in (a, b)]
    assert config[0] == config[1] and config[0]["architectures"] == ["Qwen2ForCausalLM"]


def test_export_overwrite_and_crash(tmp_path, monkeypatch):
    model = _model()
    out = export_hf(model, tmp_path / "export")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(model, out)
    monkeypatch.setattr(fs, "sync_tree", lambda *a, **k: (_ for _ in ()).throw(OSError("simulated crash")))
    with pytest.raises(OSError, match="simulated crash"):
        export_hf(_model(seed=1), out, overwrite=True)
    monkeypatch.undo()
    assert (out / "model.safetensors").read_bytes() == before  # the old export is intact
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    export_hf(_model(seed=1), out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


# ------------------------------------------------------------------------------- untrusted checkpoints


class _RunsCode:
    """What an attacker pickles: unpickling it calls os.system (here: creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _forge(ckpt, rel, data: bytes):
    """Replace (or add) one file of a checkpoint and make its manifest agree: the attacker controls every file."""
    import hashlib

    (ckpt / rel).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["files"].setdefault(rel, {})
    if isinstance(entry, dict):
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    else:
        manifest["files"][rel] = len(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    """A kind "sharded" checkpoint: a tiny Qwen2 under FSDP2 in a 1-rank gloo group, one step trained."""
    import torch.distributed as dist

    from fp8train.train.distributed import DistributedConfig, World, apply_fsdp

    root = tmp_path_factory.mktemp("sharded")
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1)
    try:
        model = _model()
        apply_fsdp(model, DistributedConfig(), World())
        cfg = OptimConfig(lr=1e-2, min_lr=1e-3, schedule="wsd", warmup_steps=2, decay_steps=3)
        opt = build_optimizer(model, cfg)
        sched = build_scheduler(opt, cfg, total_steps=10)
        _step(model, opt, sched)
        path = save_checkpoint(root / "ckpts", 1, model=model, optimizer=opt, scheduler=sched,
                               train_state={"step": 1}, config={"seed": 0})
    finally:
        dist.destroy_process_group()
    return path


@pytest.fixture
def sharded_copy(sharded_ckpt, tmp_path):
    return Path(shutil.copytree(sharded_ckpt, tmp_path / sharded_ckpt.name))


def _one_line_naming(error, name: str) -> str:
    message = str(error.value)
    assert "\n" not in message and name in message, message
    return message


def test_sharded_checkpoint_layout_and_plain_load(sharded_ckpt):
    manifest = json.loads((sharded_ckpt / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["kind"], manifest["step"]) == \
        ("fp8train-checkpoint", 2, "sharded", 1)
    assert {"dcp/.metadata", "train_state.pt", "config.yaml"} <= set(manifest["files"])
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    umask = os.umask(0)
    os.umask(umask)
    for p in [sharded_ckpt, *sharded_ckpt.rglob("*")]:  # the umask's modes (not mkdtemp's 0700)
        assert p.stat().st_mode & 0o777 == (0o777 if p.is_dir() else 0o666) & ~umask, p
    ckpt = verify_checkpoint(sharded_ckpt)
    assert ckpt.kind == "sharded" and (sharded_ckpt / "config.yaml").read_text() == "seed: 0\n"
    model, opt, sched = _setup(seed=7)  # no process group: DCP reshards to one plain process
    assert load_checkpoint(sharded_ckpt, model=model, optimizer=opt, scheduler=sched) == {"step": 1}
    assert sched.last_epoch == 1 and opt.state


@pytest.mark.parametrize("protocol", [0, 4])
def test_forged_sharded_metadata_runs_no_code(sharded_copy, tmp_path, protocol):
    """issue 17: DCP unpickles .metadata; a forger who also rewrites the manifest must not run code."""
    import pickle

    marker = tmp_path / "pwned"
    _forge(sharded_copy, "dcp/.metadata", pickle.dumps(_RunsCode(marker), protocol=protocol))
    model, opt, sched = _setup(seed=7)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CorruptCheckpointError) as error:
        load_checkpoint(sharded_copy, model=model, optimizer=opt, scheduler=sched)
    assert not marker.exists()  # nothing from the file ran
    assert "posix.system" in _one_line_naming(error, "dcp/.metadata")
    _assert_state_equal(model.state_dict(), before, "model")


def test_forged_sharded_metadata_fields_are_checked(sharded_copy):
    """Metadata made only of DCP's own classes may still point DCP at other files or byte ranges."""
    import pickle

    md = pickle.loads((sharded_copy / "dcp" / ".metadata").read_bytes())  # the test's own file: trusted
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../train_state.pt"
    _forge(sharded_copy, "dcp/.metadata", pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="which the manifest does not list under dcp/") as error:
        load_checkpoint(sharded_copy, model=_model(seed=7))
    _one_line_naming(error, "dcp/.metadata")
    info.relative_path, info.length = "__0_0.distcp", 1 << 40
    _forge(sharded_copy, "dcp/.metadata", pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="byte range outside"):
        load_checkpoint(sharded_copy, model=_model(seed=7))


@pytest.mark.parametrize("name", ["../optimizer.pt", "/etc/hostname", ".", 7])
def test_forged_index_naming_a_file_outside_the_model_refused(saved, name):
    """Resume reads the files a (listed, correctly hashed) index names only from model/: the check that
    export and eval share (`index_weight_names`)."""
    _, _, second = saved
    index = json.dumps({"weight_map": {"model.norm.weight": "model.safetensors", "lm_head.weight": name}})
    _forge(second, "model/model.safetensors.index.json", index.encode())
    with pytest.raises(ValueError, match=f"weight_map entry 'lm_head.weight' -> {name!r} is not the name of a file "
                                         "directly inside") as error:
        _load_into_fresh(second)
    _one_line_naming(error, "model/model.safetensors.index.json")


@pytest.mark.parametrize("victim", ["train_state.pt", "optimizer.pt"])
def test_forged_pt_file_runs_no_code(saved, tmp_path, victim):
    _, _, second = saved
    marker = tmp_path / "pwned"
    import pickle

    _forge(second, victim, pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CorruptCheckpointError, match=r"weights_only=True") as error:
        _load_into_fresh(second)
    assert not marker.exists()
    _one_line_naming(error, victim)


def test_sharded_flipped_byte_unlisted_file_and_link_refused(sharded_copy):
    shard = next(p for p in (sharded_copy / "dcp").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"has sha256 [0-9a-f]{64}, manifest.json says") as error:
        load_checkpoint(sharded_copy, model=_model(seed=7))
    _one_line_naming(error, shard.name)
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    verify_checkpoint(sharded_copy)  # intact again
    (sharded_copy / "dcp" / "__1.metadata").write_bytes(b"planted")
    with pytest.raises(CorruptCheckpointError, match=r"__1.metadata is not listed in manifest.json"):
        verify_checkpoint(sharded_copy)
    (sharded_copy / "dcp" / "__1.metadata").unlink()
    shard.rename(shard.with_suffix(".bak"))
    shard.symlink_to(shard.with_suffix(".bak").name)
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
        verify_checkpoint(sharded_copy)


def test_checkpoint_of_an_earlier_sharded_format_refused(sharded_copy):
    (sharded_copy / "manifest.json").write_text(json.dumps({"format": "fp8train-sharded-checkpoint", "version": 1,
                                                            "files": {}}))
    with pytest.raises(CorruptCheckpointError, match="recorded no checksums"):
        verify_checkpoint(sharded_copy)


def test_train_resume_from_a_forged_checkpoint_runs_no_code(sharded_copy, tmp_path, capsys):
    """The attack of issue 17 through the CLI: `fp8train train ... resume=evil/step_...` exits 2 with one line."""
    import pickle

    from fp8train.cli import main
    from test_trainer import TINY_CONFIG, make_byte_tokenizer, tiny_overrides, write_corpus

    marker = tmp_path / "pwned"
    _forge(sharded_copy, "dcp/.metadata", pickle.dumps(_RunsCode(marker)))
    tokenizer = make_byte_tokenizer(tmp_path / "tok")
    corpus = write_corpus(tmp_path / "corpus.jsonl", n_docs=40)
    overrides = tiny_overrides(tmp_path / "w", tokenizer, corpus, resume=sharded_copy)
    capsys.readouterr()
    assert main(["train", "--no-progress", str(TINY_CONFIG), *overrides]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    error = err.splitlines()[-1]  # before it: the tokenizer's progress bar
    assert error.startswith("fp8train train: error: ") and "dcp/.metadata is not DCP checkpoint metadata" in error
    assert "Traceback" not in err
