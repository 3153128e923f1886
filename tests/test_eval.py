"""fp8train eval: end to end on a tiny random Qwen2 with the real Qwen tokenizer, metrics, bad input."""

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

import fp8train.eval.runner as runner
from fp8train.eval import Completion, EvalConfig, add_cli, extract_math_answer, load_problems, math_equal, run_eval

from _benchmarks import load_benchmark

GSM8K = Path(__file__).resolve().parents[1] / "configs" / "data" / "gsm8k" / "train_320.jsonl"  # shipped


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fp8train.data.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen2.5")  # with a ChatML chat template
    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_eval_math_end_to_end(tiny_model, tmp_path):
    cfg = EvalConfig(model=str(tiny_model), data=str(GSM8K), limit=3, samples=2, max_new_tokens=6, batch_size=6,
                     force_think=True, seed=3, out=str(tmp_path / "a"))
    m = run_eval(cfg)
    assert (m["num_problems"], m["num_samples"], m["k"], m["backend"], m["task"]) == (3, 6, 2, "hf", "math")
    for key in ("pass@1", "maj@k", "pass@k", "extracted_rate", "finished_rate"):
        assert 0.0 <= m[key] <= 1.0, key
    assert m["pass@1"] <= m["pass@k"] and 1 <= m["mean_new_tokens"] <= 6
    assert json.loads((tmp_path / "a" / "metrics.json").read_text()) == m

    rows = _rows(tmp_path / "a")
    golds = [extract_math_answer(json.loads(line)["answer"]) for line in GSM8K.read_text().splitlines()[:3]]
    assert [r["gold_answer"] for r in rows] == golds
    for r in rows:
        assert r["where"].startswith(f"{GSM8K}:")
        assert "<|im_start|>assistant\n<think>\n" in r["prompt"] and r["question"] in r["prompt"]
        assert "\\boxed{}" in r["prompt"]
        assert len(r["outputs"]) == len(r["extracted"]) == len(r["correct"]) == len(r["num_tokens"]) == 2
        assert r["extracted"] == [extract_math_answer(o) for o in r["outputs"]]
        assert r["correct"] == [a is not None and math_equal(a, r["gold_answer"]) for a in r["extracted"]]
        assert r["pass@1"] == sum(r["correct"]) / 2
        assert all(1 <= n <= 6 for n in r["num_tokens"]) and any(o for o in r["outputs"])
    assert m["pass@1"] == pytest.approx(sum(r["pass@1"] for r in rows) / 3)

    # sampling: the two samples of a problem differ; the same seed gives the same samples again
    assert any(r["outputs"][0] != r["outputs"][1] for r in rows)
    again = run_eval(EvalConfig(**{**cfg.__dict__, "out": str(tmp_path / "b")}))
    assert [r["outputs"] for r in _rows(tmp_path / "b")] == [r["outputs"] for r in rows]
    assert again["pass@1"] == m["pass@1"]


def test_eval_multiple_choice_end_to_end(tiny_model, tmp_path):
    data = tmp_path / "gpqa.jsonl"
    items = [{"Question": "Which is a prime?", "Correct Answer": "7", "W1": "8", "W2": "9", "W3": "10"},
             {"Question": "Which is even?", "Correct Answer": "4", "W1": "5", "W2": "7", "W3": "9"}]
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp8train.train.checkpoint import save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model)  # a training checkpoint: the model under model/
    ckpt = save_checkpoint(tmp_path / "ckpts", 100, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                           tokenizer=AutoTokenizer.from_pretrained(tiny_model))
    cfg = EvalConfig(model=str(ckpt), data=str(data), task="mc", greedy=True, max_new_tokens=3,
                     question_field="Question", answer_field="Correct Answer",
                     choices_field=("Correct Answer", "W1", "W2", "W3"), out=str(tmp_path / "o"))
    m = run_eval(cfg)
    assert m["num_problems"] == 2 and m["task"] == "mc"
    for r, item in zip(_rows(tmp_path / "o"), items):
        assert sorted(r["choices"]) == sorted([item["Correct Answer"], item["W1"], item["W2"], item["W3"]])
        assert r["choices"]["ABCD".index(r["gold_answer"])] == item["Correct Answer"]
        assert "Answer: $LETTER" in r["prompt"] and "\nA) " in r["prompt"] and "\nD) " in r["prompt"]
        assert r["correct"] == [r["extracted"][0] == r["gold_answer"]]


class _StubTokenizer:
    chat_template = "stub"

    def apply_chat_template(self, conv, tokenize, add_generation_prompt):
        return conv[-1]["content"]


def test_metrics_on_known_completions(tmp_path, monkeypatch):
    """pass@1 is the mean over samples then problems; maj@k votes among equivalent answers."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q1", "answer": "#### 72"}\n\n{"question": "q2", "answer": "\\\\frac{1}{2}"}\n'
                    '{"question": "q3", "answer": "1/2"}\n')
    canned = [["\\boxed{72}", "so #### 72.0", "The answer is 71."],
              ["\\boxed{0.5}", "\\boxed{3}", "\\boxed{3}"],
              ["\\boxed{1/2}", "\\boxed{3}", "\\boxed{\\dfrac{1}{2}}"]]
    monkeypatch.setattr(runner, "load_tokenizer_for", lambda model: _StubTokenizer())
    monkeypatch.setattr(runner, "generate", lambda model, tok, prompts, cfg, backend, add_special_tokens:
                        [[Completion(t, 5, True) for t in canned[int(p[1]) - 1]] for p in prompts])
    m = run_eval(EvalConfig(model="unused", data=str(data), samples=3, backend="hf", out=str(tmp_path / "o")))
    assert m["pass@1"] == pytest.approx((2 / 3 + 1 / 3 + 2 / 3) / 3)
    assert m["maj@k"] == pytest.approx(2 / 3)       # q1: 72 (2 votes), q2: 3 (wrong), q3: 1/2 ~ 1/2
    assert m["pass@k"] == 1.0 and m["extracted_rate"] == 1.0 and m["mean_new_tokens"] == 5
    rows = _rows(tmp_path / "o")
    assert [r["maj_answer"] for r in rows] == ["72", "3", "1/2"]
    assert [r["maj_correct"] for r in rows] == [True, False, True]
    assert rows[1]["where"].endswith("d.jsonl:3")    # blank lines keep file line numbers right


def test_bad_input_is_named(tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"prompt": "q2", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'question'.*--question-field"):
        load_problems(EvalConfig(model="m", data=str(bad)))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'solution'.*--answer-field"):
        load_problems(EvalConfig(model="m", data=str(bad), answer_field="solution"))
    bad.write_text('{"question": "q", "answer": "1"}\n{"question": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_problems(EvalConfig(model="m", data=str(bad)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no problems"):
        run_eval(EvalConfig(model=str(tiny_model), data=str(empty)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(EvalConfig(model="m", data=str(tmp_path / "nope.jsonl")))
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"question": "q", "choices": ["a", "b", "c"], "answer": "z"}\n')
    with pytest.raises(ValueError, match=r"mc.jsonl:1: answer 'z' is neither .* A-C"):
        load_problems(EvalConfig(model="m", data=str(mc), task="mc"))

    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for f in tiny_model.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            (no_tok / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        run_eval(EvalConfig(model=str(no_tok), data=str(GSM8K), limit=1))

    for kwargs, key in ((dict(task="essay"), "task"), (dict(top_p=0.0), "top_p"), (dict(samples=0), "samples"),
                        (dict(backend="tgi"), "backend"), (dict(temperature=0.0), "temperature")):
        with pytest.raises(ValueError, match=f"invalid {key}="):
            EvalConfig(model="m", data="d", **kwargs)
    with pytest.raises(ValueError, match="greedy"):
        EvalConfig(model="m", data="d", greedy=True, samples=4)


def test_data_folder_and_json_shapes_are_named(tmp_path, capsys):
    """A folder passed as --data is said to be a folder; a .json file of another shape than the documented
    ones (a list, or an object with 'problems') is refused in one line that names them, not per field."""
    from fp8train.cli import main

    folder = tmp_path / "data"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match=rf"data file {folder} is a folder, not a file"):
        load_problems(EvalConfig(model="m", data=str(folder)))
    single = tmp_path / "single.json"
    shapes = "expected a list of problem objects, or an object whose 'problems' is a list or an object of them; got"
    for data, got in (({"question": "1 + 1?", "answer": "2"}, "an object without 'problems' (for a single problem, "
                       "put it in a list)"), ("1 + 1?", "a string"), ({"problems": None}, "'problems' holding null")):
        single.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=re.escape(f"eval: {single}: {shapes} {got}")):
            load_problems(EvalConfig(model="m", data=str(single)))
    single.write_text(json.dumps([{"question": "1 + 1?", "answer": "2"}]))  # the single problem, in a list
    problems = load_problems(EvalConfig(model="m", data=str(single)))
    assert [(p.question, p.gold_answer) for p in problems] == [("1 + 1?", "2")]
    single.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}))
    for data, expected in ((folder, "is a folder, not a file"), (single, "got an object without 'problems'")):
        capsys.readouterr()
        assert main(["eval", "no-model", "--data", str(data), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err and "does not exist" not in err, err


def test_champ_json_and_mc_list_field(tmp_path):
    champ = tmp_path / "v0.json"
    champ.write_text(json.dumps({"problems": {"P_1": {"_text": "How many?", "_answer": "239"},
                                              "P_2": {"_text": "Is it?", "_answer": "No"}}, "hints": {}}))
    probs = load_problems(EvalConfig(model="m", data=str(champ), question_field="_text", answer_field="_answer"))
    assert [(p.question, p.gold_answer) for p in probs] == [("How many?", "239"), ("Is it?", "No")]
    assert probs[0].where.endswith("v0.json:record P_1")

    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": f"q{i}", "choices": ["w", "x", "y", "z"], "answer": a}) + "\n"
                          for i, a in enumerate([0, "B", "(C)", "z"])))
    probs = load_problems(EvalConfig(model="m", data=str(mc), task="mc", seed=5))
    assert [p.choices["ABCD".index(p.gold_answer)] for p in probs] == ["w", "x", "y", "z"]
    assert probs == load_problems(EvalConfig(model="m", data=str(mc), task="mc", seed=5))   # deterministic
    others = load_problems(EvalConfig(model="m", data=str(mc), task="mc", seed=6))
    assert [p.choices for p in others] != [p.choices for p in probs]


def test_cli_arguments():
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["eval", "M", "--data", "d.jsonl", "--samples", "4", "--temperature", "0.7",
                              "--top-p", "0.9", "--max-new-tokens", "64", "--force-think", "--task", "mc",
                              "--choices-field", "A", "B", "--no-chat-template", "--seed", "2"])
    assert (args.model, args.samples, args.temperature, args.top_p, args.max_new_tokens) == ("M", 4, 0.7, 0.9, 64)
    assert args.force_think is True and args.greedy is False and args.chat_template is False
    assert args.choices_field == ["A", "B"] and args.task == "mc" and callable(args.func)
    assert parser.parse_args(["eval", "M", "--data", "d", "--greedy"]).greedy is True


def test_eval_never_overwrites_earlier_results(tmp_path, monkeypatch):
    """An explicit --out that holds results is refused before any model loads; the default output
    folder of a repeated eval is a new numbered one."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q1", "answer": "#### 72"}\n')
    monkeypatch.setattr(runner, "load_tokenizer_for", lambda model: _StubTokenizer())
    monkeypatch.setattr(runner, "generate", lambda model, tok, prompts, cfg, backend, add_special_tokens:
                        [[Completion("\\boxed{72}", 5, True)] for _ in prompts])
    out = tmp_path / "o"
    first = run_eval(EvalConfig(model="unused", data=str(data), backend="hf", out=str(out)))
    assert first["out"] == str(out)
    before = (out / "metrics.json").read_bytes()
    monkeypatch.setattr(runner, "load_tokenizer_for", lambda model: pytest.fail("loaded a model before refusing"))
    with pytest.raises(FileExistsError, match=rf"eval: {out} already holds the results of an earlier eval"):
        run_eval(EvalConfig(model="unused", data=str(data), backend="hf", out=str(out)))
    assert (out / "metrics.json").read_bytes() == before

    monkeypatch.setattr(runner, "load_tokenizer_for", lambda model: _StubTokenizer())
    monkeypatch.chdir(tmp_path)
    outs = [run_eval(EvalConfig(model=str(tmp_path / "m"), data=str(data), backend="hf"))["out"] for _ in range(3)]
    assert outs == [str(Path("eval_results") / f"m_d{suffix}") for suffix in ("", "_2", "_3")]
    assert all((tmp_path / o / "metrics.json").is_file() for o in outs)


def test_eval_runs_with_the_requested_cpu_threads(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q1", "answer": "#### 72"}\n')
    seen = []
    monkeypatch.setattr(runner, "load_tokenizer_for", lambda model: _StubTokenizer())
    monkeypatch.setattr(runner, "generate", lambda model, tok, prompts, cfg, backend, add_special_tokens:
                        seen.append(torch.get_num_threads()) or [[Completion("72", 1, True)] for _ in prompts])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads, out in ((1, "a"), (0, "b")):
            run_eval(EvalConfig(model="m", data=str(data), backend="hf", cpu_threads=threads, out=str(tmp_path / out)))
            assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]  # one thread by default on a CPU; 0 keeps torch's setting
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    assert parser.parse_args(["eval", "M", "--data", "d"]).cpu_threads == 1
    assert parser.parse_args(["eval", "M", "--data", "d", "--threads", "0"]).cpu_threads == 0


def test_the_fidelity_benchmark_generates_through_the_package(tiny_model):
    """benchmarks/fidelity.py has no generation of its own: its greedy answers are fp8train.eval's."""
    from fp8train.eval import SamplingConfig, generate, load_tokenizer_for

    fidelity = load_benchmark("fidelity")
    tok = load_tokenizer_for(tiny_model)
    prompts = ["What is 2 + 2?", "Name a prime number."]
    outs = fidelity.generate_greedy(tiny_model, tok, prompts, max_new_tokens=5, batch_size=2, device="cpu")
    ref = generate(tiny_model, tok, prompts, SamplingConfig(greedy=True, max_new_tokens=5, batch_size=2), device="cpu")
    assert [o[0] for o in outs] == [r[0].text for r in ref] and any(o[0] for o in outs)
    assert [(o[1], o[2]) for o in outs] == [(r[0].finished, r[0].num_tokens - r[0].finished) for r in ref]
