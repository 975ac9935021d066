"""Block-FP8 refits (molt/trainer/fp8.py): the quantizer against scales worked out by hand, which tensors a
checkpoint quantizes, refusals, and FP8 tensors with their scales across the refit wire."""

from __future__ import annotations

import json

import pytest
import torch
from test_refit import _stream

from molt.trainer.fp8 import FP8, SCALE, checkpoint_fp8, quantize_blocks, quantize_chunk


def test_each_block_gets_the_scale_of_its_largest_magnitude() -> None:
    """A 3 x 5 weight in 2 x 4 blocks (uneven at both edges): scale_inv = amax / 448 per block, worked out
    by hand; values at a block's amax land on FP8's largest; an all-zero block stays zero (not NaN)."""
    w = torch.zeros(3, 5)
    w[0, 0], w[1, 3], w[0, 2] = 896.0, -224.0, 1.5   # block (0, 0): amax 896 -> scale 2
    w[1, 4] = -44.8                                   # block (0, 1): amax 44.8 -> scale 0.1
    w[2, 1] = 1.0                                     # block (1, 0): amax 1 -> scale 1/448
    q, scale = quantize_blocks(w, (2, 4))             # block (1, 1) is all zero
    assert q.dtype == FP8 and q.shape == (3, 5) and scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert torch.allclose(scale[:, 0], torch.tensor([2.0, 1 / 448])) and scale[0, 1] == pytest.approx(0.1)
    assert 0 < scale[1, 1] < 1e-30
    assert q.float()[0, 0] == 448 and q.float()[1, 3] == -112 and q.float()[0, 2] == 0.75
    assert q.float()[1, 4] == -448 and q.float()[2, 1] == 448 and q.float()[2, 4] == 0
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-3, 2, 260)   # columns of very unequal size
    q, scale = quantize_blocks(w, (128, 128))
    per_value = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    back = q.float() * per_value
    # e4m3 keeps 3 mantissa bits: off by at most 1/16 of the value, or half its smallest step (2^-9 x scale)
    assert ((back - w).abs() <= torch.maximum(w.abs() / 16, per_value * 2.0**-10)).all()


def _folder(tmp_path, quant: dict | None, names: list[str]) -> str:
    config = {"model_type": "deepseek_v3", **({"quantization_config": quant} if quant else {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    index = {"weight_map": dict.fromkeys(names, "model-00001.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(tmp_path)


def test_the_checkpoint_says_which_tensors_are_fp8_and_other_quantizations_are_refused(tmp_path) -> None:
    up = "model.layers.0.mlp.experts.3.up_proj.weight"
    names = [up, up + "_scale_inv", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"]
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert checkpoint_fp8(_folder(tmp_path, fp8, names)) == ({names[0]}, (128, 128))
    assert checkpoint_fp8(_folder(tmp_path, None, names)) is None
    for other in ({"quant_method": "fp8"}, {"quant_method": "awq", "bits": 4}):   # per-tensor FP8, AWQ
        with pytest.raises(ValueError, match="only block FP8"):
            checkpoint_fp8(_folder(tmp_path, other, names))


def test_fp8_tensors_and_their_scales_cross_the_wire(tmp_path) -> None:
    """A chunk as the trainer sends it to an FP8 engine: the named weight quantized beside its
    `weight_scale_inv`, the rest untouched; the receivers get the same bytes (with 1 KB payloads)."""
    g = torch.Generator().manual_seed(1)
    chunk = {"a.weight": torch.randn(200, 130, generator=g).to(torch.bfloat16),
             "b.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16)}
    sent = quantize_chunk(chunk, ({"a.weight"}, (128, 128)))
    assert list(sent) == ["a.weight", "a.weight_scale_inv", "b.weight"]
    assert sent["b.weight"] is chunk["b.weight"]
    assert sent["a.weight"].dtype == FP8 and sent["a.weight_scale_inv"].shape == (2, 2)
    got, _ = _stream([[sent]], 1 << 10)
    for received in got:
        assert [n for n, _ in received] == list(sent)
        for (_, tensor), want in zip(received, sent.values(), strict=True):
            assert tensor.dtype == want.dtype
            assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8))


def test_an_fp8_policy_exports_plain_tensors_that_vllm_and_transformers_read_as_such(tmp_path) -> None:
    """A policy loaded from a block-FP8 checkpoint (the tiny model's FP8 copy, bench/gpu_smoke_models.py)
    exports model.dtype tensors under plain names, so the folder must not carry the FP8
    `quantization_config`: vLLM would build FP8 layers and transformers dequantize bf16 tensors as FP8.
    On CPU transformers dequantizes the checkpoint and drops the config itself; AutoModel's GPU loader keeps
    it on the model, which the test reproduces by setting it back before the export."""
    import sys
    from pathlib import Path

    from trainerlib import one_rank
    from transformers import AutoModelForCausalLM
    from vllm import EngineArgs

    from molt.driver.compose import compose
    from molt.plan.models import model_path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_smoke_models import fp8_copy, load_weights

    fp8 = fp8_copy(Path(model_path(compose([]))), tmp_path / "fp8")
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    spec = compose([f"model.path={fp8}", "model.dtype=bfloat16"])
    with one_rank(spec) as rank:
        rank.model.config.quantization_config = quant   # as AutoModel's loader leaves it (GPU)
        rank.export_hf(str(tmp_path / "hf"))
        want = {n: p.detach().to(torch.bfloat16) for n, p in rank.model.state_dict().items()}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    exported = load_weights(tmp_path / "hf")
    assert all(t.dtype == torch.bfloat16 for t in exported.values()) and not any(
        n.endswith(SCALE) for n in exported)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16)
    assert all(torch.equal(p, want[n]) for n, p in model.state_dict().items())
    read = EngineArgs(model=str(tmp_path / "hf"), dtype="bfloat16", max_model_len=128).create_engine_config()
    assert read.model_config.quantization is None and read.quant_config is None
