"""Packed-document attention (fp8train/train/attention.py) against Hugging Face's SDPA on the CPU: the same
scores count, so a packed row's logits equal SDPA-with-the-dense-mask's, and a row of one document runs HF's
own SDPA path bit for bit. Flex's backward and compiled kernels need CUDA: tests/test_gpu.py."""

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
