"""fp8train.train.distributed on CPU with gloo: FSDP2 at world size 2 against world size 1, FP8 all-gather,
checkpoints of both kinds moving between world sizes, and a rank failing mid-save.

The multi-process scenarios run once, in forked worker processes (fork: no second import of torch and
transformers), and leave their results in files; each test asserts on one part of them. The model is a
tiny Qwen2 (hidden 256, 2 layers, tied embeddings) converted to the FP8 `hybrid` recipe (emulated on CPU).
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import Qwen2Config, Qwen2ForCausalLM

from fp8train import Fp8Format, convert_to_fp8, make_recipe, quantize
from fp8train.fp8 import ops as fp8_ops
from fp8train.fp8.operands import LinearPlan
from fp8train.fp8.fsdp import _Fp8GatheredWeight, _Fp8ShardedWeight, fp8_gather_blocker, unwrap
from fp8train.train.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from fp8train.train.distributed import (DistributedConfig, World, all_reduce_sum, apply_fsdp, destroy,
                                        gather_full_state_dict, init_distributed)

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 512, 64, 4, 4, 3e-3
CPU1 = World()
# name: (recipe, fp8_param_gather, activation checkpointing + torch.compile per layer); "+fused": the recipe's
# fuse_swiglu (the same numbers as without on the CPU, so the same single-process reference)
RUNS = {"hybrid": ("hybrid", False, False), "hybrid_fp8_gather": ("hybrid", True, False),
        "bf16": ("bf16", False, False), "hybrid_fp8_gather_ac_compile": ("hybrid", True, True),
        "hybrid_fused_ac_compile": ("hybrid+fused", False, True)}
# Tolerances on per-step losses (relative), over 4 steps in which the loss falls from 6.38 to 3.93:
# - world size 2 vs world size 1, both FSDP (BF16 params): the same computation except how the gradient
#   sum is split (each rank rounds its partial gradient to BF16 before the FP32 reduce-scatter) and GEMM
#   summation order. FP8 adds nothing: with 128 tokens per rank the 1x128 token tiles of the Wgrad
#   quantization fall on the same boundaries. Step 1 agrees to 1e-7; the rounding differences then grow
#   through the optimizer to <= 2e-4 at step 4. Bound 1e-3.
TOL_FSDP = 1e-3
# - FSDP (either world size) vs a plain single process (FP32 params under autocast, no FSDP): FSDP's
#   MixedPrecisionPolicy also runs norms, embeddings and the residual stream in BF16, and the FP8 path
#   then quantizes slightly different BF16 values (a few E4M3 values per tile move by one step).
#   Measured <= 2e-3 (FP8 gather), <= 6e-4 (BF16 gather and the bf16 recipe). Bound 5e-3, far below
#   the 10-40% per-step loss changes that a wrong gradient or a wrong batch slice would cause.
TOL_SINGLE = 5e-3


def _model(recipe: str, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    name, _, modifier = recipe.partition("+")
    convert_to_fp8(model, make_recipe(name, fuse_swiglu=modifier == "fused"))
    return model


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _batches(steps: int = STEPS) -> list[torch.Tensor]:
    """Global batches from a random Markov chain on 32 of the 512 token ids (4 successors each): the
    loss falls quickly from ln(512), so the runs compared below really train."""
    g = torch.Generator().manual_seed(1234)
    words = torch.randperm(VOCAB, generator=g)[:32]
    successors = torch.randint(0, 32, (32, 4), generator=g)
    out = []
    for _ in range(steps):
        state = torch.empty(GLOBAL_BATCH, SEQ, dtype=torch.long)
        state[:, 0] = torch.randint(0, 32, (GLOBAL_BATCH,), generator=g)
        for t in range(1, SEQ):
            state[:, t] = successors[state[:, t - 1], torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)]
        out.append(words[state])
    return out


def _train(model, optimizer, info: World, batches, probe: dict | None = None) -> list[float]:
    """The trainer's step: this rank's contiguous slice of the global batch, loss = token-loss sum /
    global token count, backpropagated x world size (FSDP averages gradients over ranks). `probe` gets
    the first step's gradients (full tensors) and the dtypes of the (sharded) gradients."""
    from torch.distributed.tensor import DTensor

    losses = []
    for ids in batches:
        per_rank = len(ids) // info.world_size
        x = ids[info.rank * per_rank:(info.rank + 1) * per_rank]
        labels = x[:, 1:]
        n_tokens = all_reduce_sum(labels.numel())
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens
        (loss * info.world_size).backward()
        if probe is not None and not probe:
            probe["grad_dtypes"] = {n: p.grad.dtype for n, p in model.named_parameters()}
            probe["grads"] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu()
                              for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(all_reduce_sum(loss.detach()).item())
    return losses


# ------------------------------------------------------------------------------------ worker scenarios


class _CountingAllGather:
    """FSDP custom all-gather that records the bytes each rank contributes (the all-gather input)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        self._inner, self.sizes = DefaultAllGather(), []

    def allocate(self, size, *, dtype, device):
        return self._inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.sizes.append(input_tensor.numel() * input_tensor.element_size())
        return self._inner(output_tensor, input_tensor, group, async_op)


def _gathered_blocks_match(model, report, info) -> dict:
    """Unshard every layer; on rank 0 compare each FP8-gathered weight with the single-process
    quantization of the full FP32 master weight, and FP8Linear's operands with its own quantization."""
    full = gather_full_state_dict(model)
    for layer in model.model.layers:
        layer.unshard()
    result = {}
    if info.rank == 0:
        for fqn in report.fp8_gather:
            mod = model.get_submodule(fqn)
            w, master = mod.weight, full[f"{fqn}.weight"]
            ref = quantize(master, (128, 128), "e4m3", pow2_scale=True)
            plan = LinearPlan.of(mod.recipe, cublas=False)
            w_op = w.fp8_operand(plan.w, plan.pow2)  # what FP8Linear's forward takes; its backward transposes it
            ops = (*w_op, *fp8_ops.transpose_weight(*w_op, plan, master.shape[1]))
            ref_ops = (*fp8_ops.quantize_weight(master, plan.w, True, False, False),
                       *fp8_ops.quantize_weight(master, plan.w_t, True, True, False))
            result[fqn] = {
                "type": type(w).__name__,
                "data": torch.equal(w._data.view(torch.uint8), ref.data.view(torch.uint8)),
                "scale": torch.equal(w._scale, ref.scale),
                "operands": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1
                                else torch.equal(a, b) for a, b in zip(ops, ref_ops)),
                "no_copy": ops[0].data_ptr() == w._data.data_ptr(),
            }
    for layer in model.model.layers:
        layer.reshard()
    return result


def _scenario_losses(info, out_dir, names=tuple(RUNS)) -> dict:
    res = {}
    for name in names:
        recipe, fp8_gather, ac_compile = RUNS[name]
        model = _model(recipe)
        if ac_compile:  # the documented order: FP8 conversion, activation checkpointing, compile, FSDP
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for layer in model.model.layers:
                layer.compile()
        report = apply_fsdp(model, DistributedConfig(fp8_param_gather=fp8_gather), info)
        counters = [_CountingAllGather() for _ in model.model.layers]
        for layer, counter in zip(model.model.layers, counters):
            layer.set_custom_all_gather(counter)
        probe = {}
        losses = _train(model, _optimizer(model), info, _batches(), probe)
        res[name] = {"losses": losses, "fp8_gather": report.fp8_gather, "bf16_gather": report.bf16_gather,
                     "report": str(report), "first_gather_bytes": [c.sizes[0] if c.sizes else None for c in counters],
                     **probe}
        if fp8_gather:
            res[name]["blocks"] = _gathered_blocks_match(model, report, info)
    return res


def _sharded_mismatches(model, optimizer, expected: dict, info) -> list[str]:
    """Keys whose local shards differ from the matching rows of the expected full tensors (bitwise)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    def same(value, full) -> bool:
        if isinstance(value, DTensor):
            return torch.equal(value.to_local(), torch.chunk(full, info.world_size)[info.rank])
        return torch.equal(value, full) if isinstance(value, torch.Tensor) else value == full

    bad = [k for k, v in unwrap(get_model_state_dict(model)).items() if not same(v, expected["model"][k])]
    osd = unwrap(get_optimizer_state_dict(model, optimizer))
    for fqn, state in osd["state"].items():
        bad += [f"{fqn}.{k}" for k, v in state.items() if not same(v, expected["optim"]["state"][fqn][k])]
    return bad


def _full_state(model, optimizer) -> dict:
    """Full model and optimizer state (rank 0 gets the tensors), the reference a reload must reproduce."""
    return {"model": gather_full_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))}


def _scenario_save_ws1(info, out_dir) -> dict:
    """FSDP2 at world size 1: 2 steps, then a kind "sharded" checkpoint for the 2-rank job to reshard."""
    model = _model("hybrid")
    apply_fsdp(model, DistributedConfig(), info)
    optimizer = _optimizer(model)
    _train(model, optimizer, info, _batches(2))
    path = save_checkpoint(out_dir / "sharded_ws1", 2, model=model, optimizer=optimizer, train_state={"step": 2})
    torch.save(_full_state(model, optimizer), out_dir / "sharded_ws1_expected.pt")
    return {"kind": verify_checkpoint(path).kind}


def _scenario_checkpoint(info, out_dir) -> dict:
    res = {}
    # a single-process checkpoint (read whole, each rank keeps its shards) and a sharded one of world size 1
    # (DCP reshards); different inits: everything must come from the checkpoint
    for name, path in (("single", out_dir / "single" / "step_00000002"),
                       ("sharded_ws1", out_dir / "sharded_ws1" / "step_00000002")):
        model = _model("hybrid", seed=7)
        apply_fsdp(model, DistributedConfig(fp8_param_gather=True), info)
        optimizer = _optimizer(model)
        state = load_checkpoint(path, model=model, optimizer=optimizer)
        expected = torch.load(out_dir / f"{name}_expected.pt")
        res[name] = {"state": state, "mismatches": _sharded_mismatches(model, optimizer, expected, info)}
    losses = _train(model, optimizer, info, _batches(3)[2:])  # the third step, continuing the 2-step run
    save_checkpoint(out_dir / "sharded_ws2", 3, model=model, optimizer=optimizer, train_state={"step": 3})
    full = _full_state(model, optimizer)
    if info.rank == 0:
        torch.save(full, out_dir / "sharded_ws2_expected.pt")
    return {**res, "resumed_loss": losses[0]}


def _scenario_failed_save(info, out_dir) -> dict:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model = _model("bf16")
    apply_fsdp(model, DistributedConfig(), info)
    optimizer = _optimizer(model)
    _train(model, optimizer, info, _batches(1))
    if info.rank == 1:  # this process only (forked): rank 1 fails while writing its shards
        def fail(self, plan, planner):
            raise OSError("injected failure on rank 1")
        FileSystemWriter.write_data = fail
    try:
        save_checkpoint(out_dir / "fail", 1, model=model, optimizer=optimizer)
        return {"error": None}
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return {"error": f"{type(e).__name__}: {e}"}


def _scenario_shard_report(info, out_dir) -> dict:
    """What `World.shard` (the trainer's FSDP hook) logs on rank 0 when FP8 all-gather is asked for: at world
    size 1 every FP8 weight falls back to a BF16 gather, for one reason."""
    import dataclasses
    import logging

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("fp8train.train.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # (this forked worker's logger only)
    report = dataclasses.replace(info, fsdp=DistributedConfig(fp8_param_gather=True)).shard(_model("hybrid"))
    return {"log": messages, "report": str(report), "bf16_gather": report.bf16_gather}


_SCENARIOS = {"losses": _scenario_losses, "checkpoint": _scenario_checkpoint, "failed_save": _scenario_failed_save,
              "save_ws1": _scenario_save_ws1, "shard_report": _scenario_shard_report,
              # at world size 1 there is nothing to all-gather: FP8 gather falls back to BF16 (tested in ws 2)
              "losses_ws1": lambda info, out_dir: _scenario_losses(info, out_dir, ("hybrid", "bf16"))}


def _worker(rank, world_size, port, out_dir, scenarios):
    torch.set_num_threads(1)  # forked after the parent used its OpenMP pool
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    info = init_distributed(DistributedConfig(backend="auto"))
    assert (info.rank, info.world_size, info.device.type) == (rank, world_size, "cpu")
    try:
        results = {name: _SCENARIOS[name](info, out_dir) for name in scenarios}
        torch.save(results, out_dir / f"rank{rank}_ws{world_size}.pt")
    finally:
        destroy()


def _launch(world_size: int, scenarios: list[str], out_dir) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world_size, port, out_dir, scenarios), nprocs=world_size, start_method="fork")
    return [torch.load(out_dir / f"rank{r}_ws{world_size}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    single, single_grads = {}, {}
    for recipe in ("hybrid", "bf16"):
        model = _model(recipe)
        probe = {}
        single[recipe] = _train(model, _optimizer(model), CPU1, _batches(), probe)
        single_grads[recipe] = probe["grads"]
    for name, (recipe, *_) in RUNS.items():  # the runs' single-process reference is their recipe's
        base = recipe.partition("+")[0]
        single[name], single_grads[name] = single[base], single_grads[base]
    # A 2-step run saved by a plain single process (kind "single"), for the 2-rank job to resume.
    model = _model("hybrid")
    optimizer = _optimizer(model)
    _train(model, optimizer, CPU1, _batches(2))
    save_checkpoint(out / "single", 2, model=model, optimizer=optimizer, train_state={"step": 2})
    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optim": get_optimizer_state_dict(model, optimizer)}, out / "single_expected.pt")
    # 1 rank with a process group: FSDP2 at world size 1 (nothing to gather, so no FP8-gather runs), and a
    # sharded checkpoint of world size 1 for the 2-rank job
    ws1 = _launch(1, ["losses_ws1", "save_ws1"], out)
    ws2 = _launch(2, ["losses", "checkpoint", "failed_save"], out)
    return {"dir": out, "single": single, "single_grads": single_grads, "ws1": ws1[0], "ws2": ws2}


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(RUNS))
def test_world_size_2_matches_world_size_1(runs, name):
    ws2 = runs["ws2"][0]["losses"][name]["losses"]
    assert ws2 == runs["ws2"][1]["losses"][name]["losses"]  # every rank sees the same global loss
    single = runs["single"][name]
    assert ws2[0] - ws2[-1] > 0.1, ws2  # it trains: the comparison is not between flat curves
    for a, c in zip(ws2, single):
        assert abs(a - c) <= TOL_SINGLE * abs(c), (name, ws2, single)
    if name in runs["ws1"]["losses_ws1"]:
        ws1 = runs["ws1"]["losses_ws1"][name]["losses"]
        for a, b in zip(ws2, ws1):
            assert abs(a - b) <= TOL_FSDP * abs(b), (name, ws2, ws1)


@pytest.mark.parametrize("name", ["hybrid", "bf16"])
def test_gradients_are_the_global_batch_gradients(runs, name):
    """First-step gradients, all-gathered: world size 2 vs 1 (FSDP) element for element, and vs the
    plain single process in total norm: the global batch's per-token mean gradient at any world size
    (a wrong loss normalization or gradient reduction would be off by a factor of 2)."""
    g2, g1 = runs["ws2"][0]["losses"][name]["grads"], runs["ws1"]["losses_ws1"][name]["grads"]
    single = runs["single_grads"][name]
    assert g2.keys() == g1.keys() == single.keys()
    for n in g1:  # measured <= 4e-3: each rank's partial gradient is rounded to BF16 before the sum
        assert (g2[n] - g1[n]).norm() <= 2e-2 * g1[n].norm(), n
    norm2 = torch.cat([g.flatten() for g in g2.values()]).norm()
    norm_single = torch.cat([g.flatten() for g in single.values()]).norm()
    assert abs(norm2 / norm_single - 1) < 1e-2  # measured 7e-5 (bf16), 2.3e-4 (hybrid)


def test_fp8_gather_matches_bf16_gather(runs):
    res = runs["ws2"][0]["losses"]
    fp8, bf16 = res["hybrid_fp8_gather"]["losses"], res["hybrid"]["losses"]
    # The FP8 gather quantizes the FP32 master; the BF16 gather quantizes its BF16 copy (double rounding
    # flips a few FP8 values per block by one ulp): same tolerance as BF16 vs FP32 parameters.
    for a, b in zip(fp8, bf16):
        assert abs(a - b) <= TOL_SINGLE * abs(b), (fp8, bf16)
    assert fp8 != bf16  # the FP8 path really ran (its weights differ in the last FP8 bits)


def test_fp8_gather_reports_fallbacks_and_grads_stay_fp32(runs):
    res = runs["ws2"][0]["losses"]["hybrid_fp8_gather"]
    # hidden 256, 2 KV heads of 64: k/v_proj have 128 rows, 64 per rank - not 128-aligned, gathered in BF16
    kv = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")]
    assert sorted(res["bf16_gather"]) == kv
    assert all("not a multiple of 128 x world size 2" in why for why in res["bf16_gather"].values())
    assert len(res["fp8_gather"]) == 10 and "BF16 all-gather (out_features 128 is not a multiple" in res["report"]
    assert set(res["grad_dtypes"].values()) == {torch.float32}  # FP32 sharded gradients of the FP32 masters
    assert runs["ws2"][0]["losses"]["hybrid"]["fp8_gather"] == []


def test_fp8_gather_halves_bytes(runs):
    res = runs["ws2"][0]["losses"]
    model = _model("hybrid")
    fp8_names = set(res["hybrid_fp8_gather"]["fp8_gather"])
    for i, layer in enumerate(model.model.layers):
        bf16_bytes = fp8_bytes = 0
        fp8_part = bf16_part = 0
        for pname, p in layer.named_parameters():
            rows = math.ceil(p.shape[0] / 2)  # FSDP pads dim 0 to equal shards
            numel = rows * math.prod(p.shape[1:])
            bf16_bytes += 2 * numel
            if f"model.layers.{i}.{pname.removesuffix('.weight')}" in fp8_names:
                gathered = numel + 4 * (rows // 128) * math.ceil(p.shape[1] / 128)  # E4M3 + FP32 block scales
                fp8_bytes += gathered
                fp8_part, bf16_part = fp8_part + gathered, bf16_part + 2 * numel
            else:
                fp8_bytes += 2 * numel
        assert res["hybrid"]["first_gather_bytes"][i] == bf16_bytes
        assert res["hybrid_fp8_gather"]["first_gather_bytes"][i] == fp8_bytes
        assert 0.5 < fp8_part / bf16_part < 0.5002  # the FP8-gathered weights move half the bytes (+ scales)
        assert fp8_bytes / bf16_bytes < 0.6  # the layer as a whole (k/v, biases and norms stay BF16)


def test_activation_checkpointing_and_compile_before_fsdp(runs):
    res = runs["ws2"][0]["losses"]
    for a, b in zip(res["hybrid_fp8_gather_ac_compile"]["losses"], res["hybrid_fp8_gather"]["losses"]):
        assert abs(a - b) <= TOL_FSDP * abs(b)  # recomputation and compiled kernels: same numbers (measured: equal)


def test_fp8_gathered_blocks_equal_single_process_quantization(runs):
    blocks = runs["ws2"][0]["losses"]["hybrid_fp8_gather"]["blocks"]
    assert len(blocks) == 10
    for fqn, check in blocks.items():
        assert check == {"type": "_Fp8GatheredWeight", "data": True, "scale": True, "operands": True,
                         "no_copy": True}, fqn


@pytest.mark.parametrize("kind", ["single", "sharded_ws1"])
def test_resume_at_2_ranks_from_1_rank_checkpoint(runs, kind):
    assert runs["ws1"]["save_ws1"]["kind"] == "sharded"
    for rank in (0, 1):
        res = runs["ws2"][rank]["checkpoint"][kind]
        assert res["state"] == {"step": 2}
        assert res["mismatches"] == [], res["mismatches"]
    # the third step after resuming matches the uninterrupted single-process run's third step
    resumed = runs["ws2"][0]["checkpoint"]["resumed_loss"]
    uninterrupted = runs["single"]["hybrid"][2]  # _batches(3) is the first three of _batches()
    assert abs(resumed - uninterrupted) <= TOL_SINGLE * uninterrupted


def test_resume_at_1_rank_from_2_rank_checkpoint(runs):
    path = runs["dir"] / "sharded_ws2" / "step_00000003"
    ckpt = verify_checkpoint(path)
    assert (ckpt.kind, ckpt.world_size, ckpt.step) == ("sharded", 2, 3)
    assert sorted(p.name for p in (path / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model = _model("hybrid", seed=11)
    optimizer = _optimizer(model)
    assert load_checkpoint(ckpt, model=model, optimizer=optimizer) == {"step": 3}
    expected = torch.load(runs["dir"] / "sharded_ws2_expected.pt")
    # gather_full_state_dict keeps tied weights one tensor (torch.save kept the sharing)
    assert expected["model"]["lm_head.weight"].data_ptr() == expected["model"]["model.embed_tokens.weight"].data_ptr()
    state = model.state_dict()
    assert state.keys() == expected["model"].keys()
    for k, v in expected["model"].items():
        assert torch.equal(state[k], v), k
    osd = get_optimizer_state_dict(model, optimizer)
    assert osd["state"].keys() == expected["optim"]["state"].keys()
    for fqn, st in expected["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(osd["state"][fqn][k], v), (fqn, k)
    assert osd["param_groups"][0]["lr"] == LR


def test_rank_failing_mid_save_leaves_no_checkpoint(runs):
    root = runs["dir"] / "fail"
    errors = [runs["ws2"][r]["failed_save"]["error"] for r in (0, 1)]
    assert all(e is not None for e in errors), errors  # every rank raised (none hangs, none thinks it saved)
    assert "injected failure on rank 1" in errors[1]
    assert sorted(p.name for p in root.iterdir()) == []  # no checkpoint, no temp directory
    with pytest.raises(FileNotFoundError):
        load_checkpoint(root / "step_00000001", model=_model("bf16"))


def test_fp8_gather_eligibility():
    model = _model("hybrid")
    q, k = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    assert fp8_gather_blocker(q, 2) is None and fp8_gather_blocker(q, 1) == "world size 1: nothing to all-gather"
    assert "not a multiple of 128 x world size 4" in fp8_gather_blocker(q, 4)  # 256 rows: 64 per rank
    assert "not a multiple of 128 x world size 2" in fp8_gather_blocker(k, 2)
    assert fp8_gather_blocker(model.lm_head, 2) == "not an FP8 Linear"
    tensorwise = _model("tensorwise").model.layers[0].self_attn.q_proj
    assert fp8_gather_blocker(tensorwise, 2) == "recipe 'tensorwise' has no 128x128 weight blocks"


def test_sharded_weight_behaves_as_its_fp32_tensor():
    base = torch.randn(256, 128)
    w = _Fp8ShardedWeight(base.clone(), Fp8Format.E4M3, True)
    assert w.dtype == torch.float32 and w.shape == (256, 128)
    assert type(w * 2) is torch.Tensor and torch.equal(w * 2, base * 2)
    assert type(w.detach()) is _Fp8ShardedWeight and type(w.new_zeros(4, 128)) is _Fp8ShardedWeight
    w.add_(1.0)  # optimizer updates land in the wrapped tensor
    assert torch.equal(unwrap({"w": w})["w"], base + 1)
    (data, scale), meta = w.fsdp_pre_all_gather(None, None, None, None, None)
    ref = quantize(base + 1, (128, 128), "e4m3", pow2_scale=True)
    assert meta is None and torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale, ref.scale) and scale.shape == (2, 1)


@pytest.mark.parametrize("cublas", [False, True])
def test_gathered_weight_gives_fp8linear_its_operands(monkeypatch, cublas):
    """The operands FP8Linear takes from an FP8-gathered weight (W in the forward, its transpose W.T in the
    backward) equal the ones it would quantize itself, including the cuBLAS layout (contraction padded to
    512 with zero data and scale 1), bit for bit."""
    monkeypatch.setattr(fp8_ops, "_kernels", None)  # the reference layout, on any machine
    w = torch.randn(256, 384) * torch.logspace(-3, 1, 384)  # K=384 and N=256 both need padding to 512
    q = quantize(w, (128, 128), "e4m3", pow2_scale=True)
    gathered = _Fp8GatheredWeight(q.data, q.scale, torch.bfloat16, Fp8Format.E4M3, True)
    plan = LinearPlan.of(make_recipe("hybrid"), cublas)
    w_op = gathered.fp8_operand(plan.w, plan.pow2)
    got = (w_op, fp8_ops.transpose_weight(*w_op, plan, 384))
    ref = (fp8_ops.quantize_weight(w, plan.w, True, False, cublas), fp8_ops.quantize_weight(w, plan.w_t, True, True, cublas))
    for (a, a_s), (b, b_s) in zip(got, ref):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(a_s, b_s)
    assert gathered.dtype == torch.bfloat16 and torch.equal((gathered * 1).float(), q.dequantize().bfloat16().float())
    with pytest.raises(RuntimeError, match="does not match the layer's weight operand"):
        gathered.fp8_operand(plan.w, False)
    with pytest.raises(RuntimeError, match="read-only"):
        gathered.add_(1.0)


def test_single_process_is_unchanged():
    info = init_distributed(DistributedConfig())
    assert (info.rank, info.world_size) == (0, 1)
    model = _model("hybrid")
    params = dict(model.named_parameters())
    report = apply_fsdp(model, DistributedConfig(fp8_param_gather=True), info)
    assert str(report) == "fp8train: FSDP off (single process)"
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all_reduce_sum(3) == 3 and all_reduce_sum(2.5) == 2.5
    t = torch.tensor([1.5, 2.0])
    assert torch.equal(all_reduce_sum(t), t) and all_reduce_sum(t) is not t
    with pytest.raises(TypeError, match="all_reduce_sum"):
        all_reduce_sum("3")
    with pytest.raises(ValueError, match="distributed.backend"):
        init_distributed(DistributedConfig(backend="mpi"))


def test_start_up_log_names_bf16_gathered_weights_and_why(tmp_path):
    """docs/distributed.md: with fp8_param_gather, the start-up report names each weight gathered in BF16
    and says why; World.shard logs that report, not only counts."""
    res = _launch(1, ["shard_report"], tmp_path)[0]["shard_report"]
    assert len(res["bf16_gather"]) == 14 and res["log"] == [res["report"]]
    assert ("BF16 all-gather (world size 1: nothing to all-gather): model.layers.0.self_attn.q_proj, "
            "model.layers.0.self_attn.k_proj") in res["log"][0]


def test_partial_torchrun_environment_is_an_error(monkeypatch):
    """A launch or config mistake is the user's: ValueError (one line, exit 2 from the CLI), not RuntimeError."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is missing"):
        init_distributed(DistributedConfig(backend="gloo"))
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        init_distributed(DistributedConfig(backend="gloo"))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 is outside 0..WORLD_SIZE-1"):
        init_distributed(DistributedConfig(backend="gloo"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'distributed.backend' is nccl but CUDA is not available; use gloo"):
        init_distributed(DistributedConfig(backend="nccl"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but only 2 GPUs are visible"):
        init_distributed(DistributedConfig(backend="auto"))

