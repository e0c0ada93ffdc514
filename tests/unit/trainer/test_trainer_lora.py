"""LoRA (model.lora.*) on a tiny random Qwen2: the adapters, their PEFT directory, and the torch
backend training only them (export merged, checkpoint of the adapters and their optimiser state)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_trainer_torch_backend import make_batch
from transformers import AutoModelForCausalLM

from areal_jobs.config import (
    AlgoConfig,
    DType,
    JobConfig,
    LoraConfig,
    LoraFinal,
    LoraShip,
    ModelConfig,
    TrainerBackend,
    TrainerConfig,
)
from areal_jobs.trainer.forward import lora
from areal_jobs.trainer.torch.backend import TorchBackend

LORA = LoraConfig(rank=4, alpha=8.0)
IDS = torch.tensor([[5, 17, 33, 2, 91, 14, 7]])


def load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def randomise_adapters(model, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.lora_layers(model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.05)


def make_backend(path, cfg=LORA, lr=1e-2) -> TorchBackend:
    backend = TorchBackend(
        TrainerConfig(max_tokens_per_microbatch=64, lr=lr), AlgoConfig(), str(path), DType.float32, cfg
    )
    backend.setup()
    return backend


def test_adapters_start_as_the_base_model_and_alone_train(tiny_model_dir):
    base, model = load(tiny_model_dir), load(tiny_model_dir)
    wrapped = lora.apply_lora(model, LORA)
    assert len(wrapped) == 2 * 7  # two layers x q,k,v,o,gate,up,down
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in trainable
    assert model.state_dict()["model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 128)
    assert {n for n in model.state_dict() if not lora.is_adapter_key(n)} == set(base.state_dict())


def test_merged_state_merge_and_unmerge_compute_what_the_adapters_compute(tiny_model_dir):
    model = load(tiny_model_dir)
    lora.apply_lora(model, LORA)
    randomise_adapters(model)
    weights_before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        adapted = model(IDS).logits
        plain = load(tiny_model_dir)
        plain.load_state_dict(lora.merged_state(model.state_dict(), LORA.scaling))
        assert (plain(IDS).logits - adapted).abs().max() < 1e-5
        assert (plain(IDS).logits - load(tiny_model_dir)(IDS).logits).abs().max() > 1e-3  # it moved
        for k, v in model.state_dict().items():  # merged_state never touches the model
            assert torch.equal(v, weights_before[k]), k
        lora.merge_(model)
        assert (model(IDS).logits - adapted).abs().max() < 1e-5
        lora.unmerge_(model)
        assert (model(IDS).logits - adapted).abs().max() < 1e-5


def test_peft_directory_has_peft_names_and_config_and_reads_back(tiny_model_dir, tmp_path):
    model = load(tiny_model_dir)
    lora.apply_lora(model, LORA)
    randomise_adapters(model)
    adapters = lora.adapter_state(model.state_dict())
    size = lora.write_adapter_dir(tmp_path / "a", adapters, LORA, str(tiny_model_dir))
    on_disk = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert size == (tmp_path / "a" / "adapter_model.safetensors").stat().st_size
    assert set(on_disk) == {"base_model.model." + k for k in adapters}
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert on_disk[key].shape == (128, 4)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    cfg, base, tensors = lora.read_adapter_dir(tmp_path / "a")
    assert (cfg.rank, cfg.alpha, base) == (4, 8.0, str(tiny_model_dir))
    assert all(torch.equal(tensors[k], v) for k, v in adapters.items())
    assert not (tmp_path / "a.tmp").exists()


def test_bad_targets_are_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match=r"matches no linear layer.*q_proj"):
        lora.apply_lora(load(tiny_model_dir), LoraConfig(rank=2, target_modules=["query_key_value"]))
    with pytest.raises(ValueError, match="lm_head is not supported"):
        lora.apply_lora(load(tiny_model_dir), LoraConfig(rank=2, target_modules=["lm_head"]))


def test_config_validates_and_megatron_refuses_lora():
    with pytest.raises(ValueError, match="model.lora.rank must be >= 0"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match=r"set model.lora.rank > 0"):
        LoraConfig(ship=LoraShip.adapter)
    with pytest.raises(ValueError, match=r"set model.lora.rank > 0"):
        LoraConfig(final_hf=LoraFinal.adapter)
    with pytest.raises(
        ValueError, match=r"model.lora.rank=8 is not implemented by trainer=megatron.*torch/fsdp"
    ):
        JobConfig(
            model=ModelConfig(lora=LoraConfig(rank=8)), trainer=TrainerConfig(backend=TrainerBackend.megatron)
        )
    for backend in (TrainerBackend.torch, TrainerBackend.fsdp):
        JobConfig(model=ModelConfig(lora=LoraConfig(rank=8)), trainer=TrainerConfig(backend=backend))
    assert LoraConfig(rank=8, alpha=16).scaling == 2.0


def test_torch_backend_trains_the_adapters_only_and_exports_them_merged(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir)
    base = {k: v.clone() for k, v in backend.model.state_dict().items() if not lora.is_adapter_key(k)}
    metrics = backend.train_step(make_batch())
    state = backend.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the base is frozen
    assert any(state[k].abs().max() > 0 for k in lora.adapter_state(state) if k.endswith("lora_B.weight"))
    trainable = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    assert metrics["memory/trainable_param_bytes"] == 4 * trainable < metrics["memory/param_bytes"] / 5
    # AdamW: exp_avg and exp_avg_sq per adapter parameter (plus a step count per tensor)
    assert 8 * trainable <= metrics["memory/optimizer_state_bytes"] < 8 * trainable + 4096
    # the export: exactly the base checkpoint's names, the adapters merged in
    exported = dict(backend.iter_weights())
    assert [s.name for s in backend.weight_specs()] == list(exported)
    assert set(exported) == set(load_file(str(tiny_model_dir / "model.safetensors")))
    backend.save_hf(str(tmp_path / "hf"))
    assert set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == set(exported)
    backend.model.eval()
    with torch.no_grad():
        gap = (load(tmp_path / "hf")(IDS).logits - backend.model(IDS).logits).abs().max()
        assert gap < 1e-5
    backend.save_adapter(str(tmp_path / "adapter"))
    assert lora.is_adapter_dir(tmp_path / "adapter")


def test_checkpoint_holds_adapters_and_optimiser_state_and_resumes_exactly(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir)
    backend.train_step(make_batch(seed=1))
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    assert saved["model"] and all(lora.is_adapter_key(k) for k in saved["model"])
    assert len(saved["optimizer"]["state"]) == len(saved["model"])  # AdamW state of the adapters only
    after_one = backend.train_step(make_batch(seed=2))
    resumed = make_backend(tiny_model_dir)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    again = resumed.train_step(make_batch(seed=2))
    assert again["train/loss"] == pytest.approx(after_one["train/loss"], abs=1e-7)
    for (k, a), b in zip(
        backend.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)
    other = make_backend(tiny_model_dir, LoraConfig(rank=2))
    with pytest.raises((ValueError, RuntimeError)):  # another rank's adapters do not fit
        other.load_checkpoint(str(tmp_path / "ckpt"))


def test_full_fine_tuning_is_unchanged_by_rank_zero(tiny_model_dir):
    backend = make_backend(tiny_model_dir, LoraConfig(), lr=1e-3)
    assert all(p.requires_grad for p in backend.model.parameters())
    assert not lora.lora_layers(backend.model)
    metrics = backend.train_step(make_batch())
    assert metrics["memory/trainable_param_bytes"] == metrics["memory/param_bytes"]
    assert np.isfinite(metrics["train/loss"])


def test_make_eval_serves_lora_checkpoints_merged(tiny_model_dir, tmp_path):
    """launch.evaluate's checkpoint argument: a PEFT adapter directory (final_hf=adapter) and a
    mid-run torch checkpoint of a LoRA run both become plain HF directories with the policy's logits."""
    from areal_jobs.config import JobConfig, save_job_config
    from launch.evaluation.checkpoint import resolve_hf_dir

    backend = make_backend(tiny_model_dir)
    backend.train_step(make_batch())
    backend.model.eval()
    with torch.no_grad():
        expected = backend.model(IDS).logits
    backend.save_adapter(str(tmp_path / "final_hf"))
    lora.copy_tokenizer(tiny_model_dir, tmp_path / "final_hf")
    merged = resolve_hf_dir(str(tmp_path / "final_hf"))
    assert merged == tmp_path / "final_hf" / "merged" and (merged / "tokenizer.json").exists()
    with torch.no_grad():
        assert (load(merged)(IDS).logits - expected).abs().max() < 1e-5
    assert resolve_hf_dir(str(tmp_path / "final_hf")) == merged  # merged once

    run_dir = tmp_path / "run"
    cfg = JobConfig()
    cfg.model.path, cfg.model.lora = str(tiny_model_dir), LORA
    save_job_config(cfg, run_dir / "config.yaml")
    backend.save_checkpoint(str(run_dir / "checkpoints" / "step_000001" / "trainer"))
    hf = resolve_hf_dir(str(run_dir / "checkpoints" / "step_000001"))
    assert set(load_file(str(hf / "model.safetensors"))) == set(
        load_file(str(tiny_model_dir / "model.safetensors"))
    )
    with torch.no_grad():
        assert (load(hf)(IDS).logits - expected).abs().max() < 1e-5


def test_adapter_parameter_count_for_the_memory_model(tiny_model_dir):
    """LoraConfig.adapter_params (pure: the memory model's trainable parameters) counts exactly
    what apply_lora attaches, for every target and for a subset."""
    from transformers import AutoConfig

    from areal_jobs.config.lora import decoder_projections

    hf = AutoConfig.from_pretrained(str(tiny_model_dir))
    head_dim = hf.hidden_size // hf.num_attention_heads
    shapes = decoder_projections(
        hf.hidden_size, hf.intermediate_size, hf.num_attention_heads, hf.num_key_value_heads, head_dim
    )
    for cfg in (LoraConfig(rank=8), LoraConfig(rank=3, target_modules=["q_proj", "v_proj"])):
        model = load(tiny_model_dir)
        lora.apply_lora(model, cfg)
        attached = sum(p.numel() for p in lora.trainable_parameters(model))
        assert cfg.adapter_params(hf.num_hidden_layers, shapes) == attached
    assert LoraConfig().adapter_params(2, shapes) == 0
