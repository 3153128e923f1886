"""Configs: presets, strict parsing (unknown keys, types, batch divisibility), overrides, round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from fp8train.train.config import ConfigError, config_to_dict, format_config_help, load_config
from fp8train.train.schema import parse_overrides
from fp8train.data import CptDataConfig, SftDataConfig

CONFIGS = Path(__file__).parent.parent / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
CPT = ["stage=cpt", "data.paths=[corpus.txt]", "train.steps=10"]


def test_every_preset_loads():
    names = {p.name for p in PRESETS}
    assert {"qwen2.5-1.5b_cpt.yaml", "qwen2.5-7b_cpt.yaml", "qwen2.5-1.5b_sft.yaml", "qwen2.5-7b_sft.yaml",
            "tiny_cpt.yaml", "tiny_sft.yaml"} <= names
    for path in PRESETS:
        cfg = load_config(path)
        assert isinstance(cfg.data, CptDataConfig if cfg.stage == "cpt" else SftDataConfig), path
        assert cfg.recipe == "hybrid", path


@pytest.mark.parametrize("size", ["1.5b", "7b"])
def test_paper_cpt_recipe(size):
    cfg = load_config(CONFIGS / f"qwen2.5-{size}_cpt.yaml")
    assert (cfg.stage, cfg.data.seq_len, cfg.train.global_batch, cfg.train.steps) == ("cpt", 32768, 128, 40000)
    o = cfg.optim
    assert (o.betas, o.weight_decay, o.grad_clip) == ((0.9, 0.95), 0.1, 1.0)
    assert (o.schedule, o.warmup_steps, o.decay_steps, o.lr, o.min_lr) == ("wsd", 5000, 5000, 1e-4, 1e-5)


@pytest.mark.parametrize("size,peak,final", [("1.5b", 5e-5, 5e-6), ("7b", 2e-5, 2e-6)])
def test_paper_sft_recipe(size, peak, final):
    cfg = load_config(CONFIGS / f"qwen2.5-{size}_sft.yaml")
    assert (cfg.stage, cfg.data.seq_len, cfg.train.global_batch, cfg.train.epochs, cfg.train.steps) == \
        ("sft", 32768, 64, 5.0, None)
    o = cfg.optim
    assert (o.schedule, o.warmup_ratio, o.lr, o.min_lr, o.weight_decay, o.betas) == \
        ("cosine", 0.05, peak, final, 0.0, (0.9, 0.95))


def test_overrides_are_yaml_scalars():
    cfg = load_config(None, CPT + ["optim.lr=3e-4", "recipe=bf16", "train.keep_last=null",
                                   "optim.betas=[0.8, 0.99]", "data.paths=[a.txt, b.txt]", "train.compile=true"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 3e-4 as a string
    assert cfg.recipe == "bf16" and cfg.train.keep_last is None and cfg.train.compile is True
    assert cfg.optim.betas == (0.8, 0.99) and cfg.data.paths == [str(Path.cwd() / "a.txt"), str(Path.cwd() / "b.txt")]
    assert parse_overrides(["a.b.c=1", "a.b.d=x", "e="]) == {"a": {"b": {"c": 1, "d": "x"}}, "e": None}


def test_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stage: cpt\ndata: {paths: [x], seq_len: 64}\ntrain: {steps: 5, micro_batch: 2}\n")
    cfg = load_config(path, ["data.seq_len=128"])
    assert (cfg.data.seq_len, cfg.data.paths, cfg.train.micro_batch) == (128, [str(tmp_path / "x")], 2)


@pytest.mark.parametrize("override,key,hint", [
    ("optim.lrr=1", "optim.lrr", "optim.lr"),
    ("train.stepz=3", "train.stepz", "'train.steps'"),
    ("recipee=bf16", "recipee", "recipe"),
    ("data.seq_length=64", "data.seq_length", "seq_len"),
    ("model.sorce=x", "model.sorce", "source"),
    ("data.overlong=skip", "data.overlong", None),  # an SFT-only key under stage cpt
])
def test_unknown_keys_name_the_full_dotted_key(override, key, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, CPT + [override])
    assert f"unknown config key {key!r}" in str(e.value)
    if hint:
        assert "did you mean" in str(e.value) and hint in str(e.value)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stage: cpt\ndata: {paths: [x]}\ntrain: {steps: 5, eval_evry: 2}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3: unknown config key 'train\.eval_evry' \(did you mean 'train\.eval_every'"):
        load_config(path)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("seed: 1\noptim: {lr: 3\ntrain:\n  steps: 2\n")  # an unclosed flow mapping
    with pytest.raises(ConfigError, match=r"broken\.yaml:3: not valid YAML \(expected ',' or '\}', but got ':', "
                                          r"column 6\)$"):
        load_config(path)


def test_override_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="'recipe' is set to a value"):
        load_config(None, CPT + ["recipe=bf16", "recipe.x=1"])


@pytest.mark.parametrize("override,key", [
    ("train.steps=abc", "train.steps"),
    ("optim.lr=fast", "optim.lr"),
    ("train.compile=3", "train.compile"),
    ("train.global_batch=2.5", "train.global_batch"),
    ("recipe=fp4", "recipe"),
    ("data.paths=notalist", None),  # a lone string is accepted as one path by the data config
    ("model=3", "model"),
    ("optim.betas=[0.9]", "optim.betas"),
])
def test_wrong_types_name_the_key(override, key):
    if key is None:
        assert load_config(None, CPT + [override]).data.paths == [str(Path.cwd() / "notalist")]
        return
    with pytest.raises(ConfigError, match=f"config key '{key}"):
        load_config(None, CPT + [override])


def test_global_batch_must_divide():
    with pytest.raises(ConfigError, match=r"'train.global_batch' \(10\).*'train.micro_batch' \(4\)"):
        load_config(None, CPT + ["train.global_batch=10", "train.micro_batch=4"])
    cfg = load_config(None, CPT + ["train.global_batch=12", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"world size \(8\)"):
        cfg.validate(world_size=8)
    cfg.validate(world_size=3)


def test_cuda_graphs_need_compile():
    with pytest.raises(ConfigError, match=r"'train.cuda_graphs' needs 'train.compile'"):
        load_config(None, CPT + ["train.cuda_graphs=true"])
    assert load_config(None, CPT + ["train.cuda_graphs=true", "train.compile=true"]).train.cuda_graphs


def test_wgrad_blocks_only_with_hybrid():
    for recipe in ("tensorwise", "rowwise"):
        with pytest.raises(ConfigError, match=rf"'wgrad_blocks': wgrad_blocks applies to the hybrid recipe, not '{recipe}'"):
            load_config(None, CPT + ["wgrad_blocks=true", f"recipe={recipe}"])
    for recipe in ("hybrid", "bf16"):  # bf16 (the comparison arm of the same config): nothing in FP8 to change
        assert load_config(None, CPT + ["wgrad_blocks=true", f"recipe={recipe}"]).wgrad_blocks


def test_fuse_row_quantization_needs_power_of_two_scales():
    with pytest.raises(ConfigError, match=r"config key 'fuse_row_quantization': fuse_row_quantization needs "
                                          r"power-of-two scales \(pow2_scale\)") as e:
        load_config(None, CPT + ["fuse_row_quantization=true", "pow2_scale=false"])
    assert e.value.keys == ("fuse_row_quantization", "pow2_scale")
    assert load_config(None, CPT + ["fuse_row_quantization=true"]).fp8_recipe().fuse_row_quantization
    assert not load_config(None, CPT + ["pow2_scale=false"]).fp8_recipe().pow2_scale


def test_fp8_recipe_names_the_key_that_failed():
    """A recipe name the schema would refuse, set in code: the error names `recipe`, not `wgrad_blocks`."""
    cfg = dataclasses.replace(load_config(None, CPT), recipe="fp4")
    with pytest.raises(ConfigError, match=r"config key 'recipe': unknown FP8 recipe 'fp4'") as e:
        cfg.fp8_recipe()
    assert e.value.keys == ("recipe",)
    cfg = dataclasses.replace(load_config(None, CPT), recipe="tensorwise", wgrad_blocks=True)
    with pytest.raises(ConfigError, match=r"config key 'wgrad_blocks'") as e:
        cfg.fp8_recipe()
    assert e.value.keys == ("wgrad_blocks", "recipe")
    assert load_config(None, CPT + ["wgrad_blocks=true"]).fp8_recipe().grad_weight.b.block == (128, 128)


def test_missing_and_inconsistent_sections():
    with pytest.raises(ConfigError, match="missing required config section 'data'"):
        load_config(None, ["train.steps=3"])
    with pytest.raises(ConfigError, match="'train.steps' or 'train.epochs'"):
        load_config(None, ["data.paths=[x]"])
    with pytest.raises(ConfigError, match="data"):
        load_config(None, ["data.paths=[]", "train.steps=3"])  # the data config's own check, under its section


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "qwen2.5-7b_sft.yaml", ["optim.lr=1e-5", "train.keep_last=null"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert load_config(path) == cfg


def test_help_lists_every_key_with_its_docstring():
    text = format_config_help()
    for key in ("recipe", "pow2_scale", "resume", "model.source", "optim.lr", "train.max_nonfinite_steps",
                "train.activation_checkpointing", "data.seq_len", "data.overlong", "data.document_masking"):
        assert f"  {key}:" in text, key
    assert "Stop with an error after this many NaN/Inf steps" in text
    assert "stage: cpt | sft = cpt" in text


def test_errors_say_where_the_value_came_from(tmp_path):
    with pytest.raises(ConfigError) as e:  # from the command line: the override as typed, never the file
        load_config(CONFIGS / "tiny_cpt.yaml", ["data.val_fraction=2"])
    assert str(e.value).startswith("data.val_fraction=2 (command line): data.val_fraction must be in [0, 1)")
    assert "tiny_cpt.yaml" not in str(e.value) and "CptDataConfig" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^save_every=0 \(command line\): unknown config key 'save_every'"):
        load_config(CONFIGS / "tiny_cpt.yaml", ["save_every=0"])
    path = tmp_path / "c.yaml"  # from the file: file:line of the key, and its dotted name
    path.write_text("stage: cpt\ndata:\n  paths: [x]\n  val_fraction: 3\ntrain: {steps: 5}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4: data\.val_fraction must be in \[0, 1\), got 3\.0$"):
        load_config(path)
    path.write_text("stage: sft\ndata:\n  paths: [x]\n  holdout_last: -1\ntrain: {steps: 5}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4: data\.holdout_last must be >= 0"):
        load_config(path)


def test_checks_that_need_no_data_run_at_load():
    with pytest.raises(ConfigError, match=r"^train\.steps=3 \(command line\): optim\.warmup_steps .* 3 total steps"):
        load_config(None, ["stage=cpt", "data.paths=[x]", "train.steps=3", "optim.warmup_steps=5"])
    with pytest.raises(ConfigError, match=r"optim\.decay_steps \(4 steps\) exceed the 6 total"):
        load_config(None, CPT + ["train.steps=6", "optim.warmup_steps=3", "optim.decay_steps=4"])
    with pytest.raises(ConfigError, match=r"'data\.seq_len' \(4096\) is above the model's max_position_embeddings "
                                          r"\('model\.max_seq_len' = 2048\)"):
        load_config(None, CPT + ["data.seq_len=4096", "model.max_seq_len=2048"])


def test_globs_on_the_command_line_need_no_inner_quotes():
    assert load_config(None, CPT + ["data.include=[*.txt, *.md]"]).data.include == ["*.txt", "*.md"]
    assert load_config(None, CPT + ["data.include=*.txt"]).data.include == ["*.txt"]
    with pytest.raises(ConfigError, match=r"override 'optim\.lr=\[1,': the value is not valid YAML"):
        load_config(None, CPT + ["optim.lr=[1,"])


def test_input_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "c.yaml"
    path.write_text("stage: cpt\nrun_dir: runs/x\nresume: auto\nmodel: {source: tiny-qwen2, tokenizer: ../tok}\n"
                    "data: {paths: [../corpus, /abs/file.txt, ~/home.txt], cache_dir: .cache/t}\ntrain: {steps: 5}\n")
    monkeypatch.chdir(tmp_path / "cfg")  # anywhere else than the config's folder
    monkeypatch.chdir("/")
    cfg = load_config(path)
    assert cfg.data.paths == [str(tmp_path / "corpus"), "/abs/file.txt", "~/home.txt"]
    assert cfg.model.tokenizer == str(tmp_path / "tok") and cfg.model.source == "tiny-qwen2"
    assert (cfg.run_dir, cfg.data.cache_dir, cfg.resume) == ("runs/x", ".cache/t", "auto")  # outputs: the cwd
    monkeypatch.chdir(tmp_path)  # overrides: relative to the working directory
    cfg = load_config(path, ["data.paths=[here.txt]", "model.tokenizer=qwen2.5", "model.source=tiny-llama"])
    assert cfg.data.paths == [str(tmp_path / "here.txt")]
    assert (cfg.model.tokenizer, cfg.model.source) == ("qwen2.5", "tiny-llama")


def test_shipped_configs_point_at_files_that_exist():
    for name in ("tiny_cpt.yaml", "tiny_sft.yaml"):
        cfg = load_config(CONFIGS / name)
        assert cfg.data.paths and all(Path(p).exists() for p in cfg.data.paths), (name, cfg.data.paths)


def test_hf_dataset_section(tmp_path):
    cfg = load_config(None, ["stage=sft", "train.steps=3", "data.hf_dataset.name=someone/chats",
                             "data.hf_dataset.split=test", "data.hf_dataset.column=conversation"])
    h = cfg.data.hf_dataset
    assert (cfg.data.paths, h.name, h.config, h.split, h.column) == ([], "someone/chats", None, "test", "conversation")
    (tmp_path / "local_ds").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text("stage: cpt\ndata: {hf_dataset: {name: local_ds}}\ntrain: {steps: 3}\n")
    assert load_config(path).data.hf_dataset.name == str(tmp_path / "local_ds")  # a folder beside the config
    with pytest.raises(ConfigError, match=r"c\.yaml:2: missing required config key 'data\.hf_dataset\.name'"):
        path.write_text("stage: cpt\ndata: {hf_dataset: {split: train}}\ntrain: {steps: 3}\n")
        load_config(path)
    with pytest.raises(ConfigError, match=r"data\.paths is empty.*data\.hf_dataset"):
        load_config(None, ["stage=sft", "train.steps=3", "data.paths=[]"])
