"""Packed-document attention (fp8train/train/attention.py) against Hugging Face's SDPA on the CPU: the same
scores count, so a packed row's logits equal SDPA-with-the-dense-mask's, and a row of one document runs HF's
own SDPA path bit for bit; the masks the trainer makes on the host are HF's own. Flex's backward and compiled kernels need CUDA: tests/test_gpu.py."""

import json

import pytest
import torch

from fp8train.train.attention import PACKED_ATTENTION, use_packed_attention
from fp8train.train.model import ModelConfig, build_model


def _pair():
    torch.manual_seed(0)
    ref = build_model(ModelConfig(source="tiny-qwen2", vocab_size=300))
    new = build_model(ModelConfig(source="tiny-qwen2", vocab_size=300))
    new.load_state_dict(ref.state_dict())
    use_packed_attention(new)
    return ref, new


def test_packed_rows_attend_within_documents_as_hf_sdpa_does():
    """Two rows of 128 tokens: one document each (HF skips the mask: SDPA's causal kernel, the same logits bit
    for bit), then three documents of 40, 60 and 28 (HF's mask function as a block mask: the dense-mask
    logits within FP32 rounding, and far from what attending across documents gives)."""
    from torch.nn.attention.flex_attention import BlockMask

    ref, new = _pair()
    assert new.config._attn_implementation == PACKED_ATTENTION and ref.config._attn_implementation == "sdpa"
    masks = []  # the mask each attention call receives
    new.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(type(kwargs.get("attention_mask"))), with_kwargs=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 128), generator=g)
    one = torch.arange(128).expand(2, -1)
    packed = torch.cat([torch.arange(40), torch.arange(60), torch.arange(28)]).expand(2, -1)
    with torch.no_grad():
        same = [m(input_ids=ids, position_ids=one).logits for m in (ref, new)]
        assert torch.equal(*same) and set(masks) == {type(None)}
        masks.clear()
        dense, flex = (m(input_ids=ids, position_ids=packed).logits for m in (ref, new))
        assert set(masks) == {BlockMask}
        across = new(input_ids=ids, position_ids=one).logits  # the same tokens as one document
    assert (flex - dense).abs().max() <= 1e-5 * dense.abs().max()
    assert (across[:, 40:] - dense[:, 40:]).abs().max() > 100 * (flex - dense).abs().max()
    assert torch.equal(across[:, :40], same[0][:, :40])  # the first document sees the same tokens either way


def test_the_choice_stays_out_of_checkpoints(tmp_path):
    """save_pretrained writes no attention implementation, so the export loads as a plain HF model."""
    _, new = _pair()
    new.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not [k for k in config if "attn_implementation" in k], config


def test_a_peft_model_gets_it_on_its_base():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = build_model(ModelConfig(source="tiny-qwen2", vocab_size=300))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    use_packed_attention(wrapped)
    assert wrapped.get_base_model().config._attn_implementation == PACKED_ATTENTION


def _positions(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize("source", ["tiny-qwen2", "tiny-llama"])
def test_document_mask_is_hfs_own_made_on_the_host(source):
    """`document_mask` from the host's position_ids: None for rows of one document (HF's own path), for packed
    rows HF's own SDPA mask, boolean for boolean, and under flex a block mask whose mask function allows exactly
    those scores; the model's logits with it equal those HF builds for itself, bit for bit (Qwen2 and Llama)."""
    from torch.nn.attention.flex_attention import create_mask
    from transformers.masking_utils import create_causal_mask

    from fp8train.train.attention import document_mask

    torch.manual_seed(0)
    model = build_model(ModelConfig(source=source, vocab_size=300)).eval()
    cpu = torch.device("cpu")
    one = torch.arange(96).expand(2, -1)
    packed = torch.stack([_positions(40, 30, 26), _positions(10, 86)])  # each row its own documents
    assert document_mask(model.config, one, cpu) is None
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))
    hf = create_causal_mask(config=model.config, inputs_embeds=model.model.embed_tokens(ids), attention_mask=None,
                            cache=None, position_ids=packed)
    dense = document_mask(model.config, packed, cpu)
    assert torch.equal(dense, hf)
    assert dense[1, 0, 20, 5].item() is False and dense[1, 0, 20, 15].item() is True  # row 2: documents 10 + 86
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=packed).logits
        got = model(input_ids=ids, position_ids=packed, attention_mask=dense).logits
    assert torch.equal(got, want)
    use_packed_attention(model)  # the mask of the flex path: a block mask
    block = document_mask(model.config, packed, cpu)
    assert torch.equal(create_mask(block.mask_mod, 2, 1, 96, 96, device="cpu"), dense)


def test_rows_of_one_document_get_a_causal_block_mask_that_runs_hfs_sdpa_path(monkeypatch):
    """Under `PACKED_ATTENTION`, `document_mask` gives rows of one document the causal block mask (one object
    per length), which HF takes as a prepared mask without looking at `position_ids` (its check made to fail
    here) and the attention runs as HF's SDPA path with no mask: the logits equal plain SDPA's bit for bit."""
    import transformers.masking_utils
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    from fp8train.train.attention import document_mask

    ref, new = _pair()
    cpu = torch.device("cpu")
    one = torch.arange(96).expand(2, -1)
    mask = document_mask(new.config, one, cpu)
    assert isinstance(mask, BlockMask) and mask is document_mask(new.config, torch.arange(96)[None], cpu)
    assert torch.equal(create_mask(mask.mask_mod, 1, 1, 96, 96, device="cpu")[0, 0],
                       torch.ones(96, 96, dtype=torch.bool).tril())
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=one).logits

        def no_check(position_ids):
            raise AssertionError("HF checked position_ids")

        monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", no_check)
        got = new(input_ids=ids, position_ids=one, attention_mask=mask).logits
    assert torch.equal(got, want)


def test_document_mask_leaves_other_attention_to_hf_and_refuses_gpu_positions():
    from fp8train.train.attention import document_mask

    torch.manual_seed(0)
    config = build_model(ModelConfig(source="tiny-qwen2", vocab_size=300)).config
    packed = _positions(4, 4)[None]
    assert document_mask(config, packed, torch.device("cpu")) is not None
    config._attn_implementation = "eager"  # its masks are additive floats: HF's to make
    assert document_mask(config, packed, torch.device("cpu")) is None
    config._attn_implementation = "sdpa"
    config.layer_types = ["sliding_attention"] * len(config.layer_types)  # one 4-D mask would serve every layer
    assert document_mask(config, packed, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="host"):  # (meta stands for the GPU: any device but the host's)
        document_mask(config, packed.to("meta"), torch.device("cpu"))


def test_the_trainer_trains_packed_rows_as_when_hf_builds_the_masks(monkeypatch):
    """The trainer hands the model `document_mask`'s mask for packed rows; with HF left to build it (the same
    function patched to None) rows of four documents train to the same losses, bit for bit."""
    from fp8train.bench import BenchCase, run_case
    import fp8train.train.trainer as trainer_module

    def losses(docs):
        r = run_case(BenchCase("tiny-qwen2", None, 128, "hybrid", "eager", 300, docs=docs), steps=2, warmup=1,
                     device="cpu")
        return r["loss_first"], r["loss_last"]

    made, real = [], trainer_module.document_mask
    monkeypatch.setattr(trainer_module, "document_mask", lambda *args: made.append(real(*args)) or made[-1])
    ours = {d: losses(d) for d in (1, 4)}
    assert {type(m) for m in made} == {type(None), torch.Tensor}  # one document: HF's path; packed: ours
    monkeypatch.setattr(trainer_module, "document_mask", lambda *args: None)
    hf = {d: losses(d) for d in (1, 4)}
    assert ours == hf and ours[1] != ours[4]
