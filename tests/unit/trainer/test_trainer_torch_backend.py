"""The torch backend on a tiny random Qwen2: packed log-probs, one step, HF-exact weight export."""

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from areal_jobs.config import AlgoConfig, DType, TrainerConfig
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
from areal_jobs.trainer.torch.backend import TorchBackend


def make_backend(path, **algo):
    backend = TorchBackend(
        TrainerConfig(max_tokens_per_microbatch=64, lr=1e-3), AlgoConfig(**algo), str(path), DType.float32
    )
    backend.setup()
    return backend


def make_batch(seed=0, n=6, vocab=200, version=0, versions_behind=0):
    """`n` samples of random tokens trained at `version`, sampled `versions_behind` versions earlier."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        p, o = int(rng.integers(3, 9)), int(rng.integers(1, 20))
        samples.append(
            TrainSample(
                sample_id=f"g{i // 2}/{i % 2}",
                input_ids=rng.integers(1, vocab, p + o),
                num_prompt_tokens=p,
                behav_logprobs=np.full(o, -5.0, dtype=np.float32),
                versions=np.full(o, version - versions_behind, dtype=np.int32),
                advantage=float(rng.normal()),
                reward=0.0,
            )
        )
    return TrainBatch(version=version, samples=samples, group_ids=[f"g{i}" for i in range(n // 2)])


def test_packed_logprobs_equal_separate_forwards(tiny_model_dir):
    backend = make_backend(tiny_model_dir)
    batch = make_batch()
    with torch.no_grad():
        packed = token_logprobs(backend.model, batch.samples)
        for s, lp in zip(batch.samples, packed, strict=True):
            alone = token_logprobs(backend.model, [s])[0]
            assert lp.shape == (s.num_output_tokens,)
            torch.testing.assert_close(lp, alone, atol=2e-5, rtol=0)


def test_train_step_updates_weights_and_reports_metrics(tiny_model_dir):
    backend = make_backend(tiny_model_dir)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    metrics = backend.train_step(make_batch())
    assert np.isfinite(metrics["train/loss"]) and metrics["train/num_tokens"] > 0
    assert metrics["train/num_microbatches"] >= 2  # 64-token budget forces several micro-batches
    changed = [k for k, v in backend.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed


def test_zero_advantages_give_zero_loss(tiny_model_dir):
    backend = make_backend(tiny_model_dir)
    batch = make_batch()
    batch.samples = [TrainSample(**{**s.__dict__, "advantage": 0.0}) for s in batch.samples]
    assert backend.train_step(batch)["train/loss"] == pytest.approx(0.0, abs=1e-12)


def test_weight_export_is_exactly_the_hf_checkpoint(tiny_model_dir, tmp_path):
    backend = make_backend(tiny_model_dir)
    specs = backend.weight_specs()
    backend.save_hf(str(tmp_path / "hf"))
    on_disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert [s.name for s in specs] == list(dict(backend.iter_weights()))
    assert {s.name for s in specs} == set(on_disk)
    assert "lm_head.weight" not in on_disk  # tied embeddings: the checkpoint holds only the embedding
    for name, tensor in backend.iter_weights():
        assert torch.equal(tensor, on_disk[name])


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    a = make_backend(tiny_model_dir)
    a.train_step(make_batch(1))
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = make_backend(tiny_model_dir)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    ma, mb = a.train_step(make_batch(2)), b.train_step(make_batch(2))
    assert ma["train/loss"] == mb["train/loss"]
    for (na, ta), (nb, tb) in zip(a.iter_weights(), b.iter_weights(), strict=True):
        assert na == nb and torch.equal(ta, tb)


def test_several_ppo_minibatches_take_several_clipped_steps(tiny_model_dir):
    backend = make_backend(tiny_model_dir, ppo_minibatches=3, batch_size=4, group_size=2)
    batch = make_batch(n=6)
    metrics = backend.train_step(batch)
    assert metrics["train/num_minibatches"] == 3
    # after the first optimiser step the policy moved: ratios differ from 1 in later minibatches
    assert metrics["ppo/approx_kl"] != 0.0


def test_decoupled_false_anchors_on_the_behaviour_policy(tiny_model_dir):
    """Naive PPO (algo.decoupled=false): p = b, so w = 1 and r = exp(θ - b) is clipped at once
    for many tokens (behaviour log-probs -5 vs the model's), unlike the decoupled step where r = 1."""
    batch = make_batch()
    naive = make_backend(tiny_model_dir, decoupled=False).train_step(batch)
    assert naive["train/prox_behav_abs_diff"] == 0.0 and naive["mismatch/k3_kl"] == 0.0
    assert naive["ppo/behav_weight_mean"] == 1.0 and naive["ppo/clip_fraction"] > 0.2
    decoupled = make_backend(tiny_model_dir, decoupled=True).train_step(batch)
    assert decoupled["train/prox_behav_abs_diff"] > 0.1 and decoupled["ppo/clip_fraction"] == 0.0
    assert decoupled["ppo/ratio_mean"] == pytest.approx(1.0)


def test_fresh_samples_make_decoupled_and_naive_the_same_step(tiny_model_dir):
    """eta = 0: the behaviour policy is the trainer's own, so the proximal anchor equals it and the
    two objectives are one loss. With 4 minibatches (the later ones anchored on the pre-step
    log-probs, the first on its own gradient pass) both steps give the same metrics and weights.
    (The ablation's unstable lr 3e-4 / 6e-4 cells at eta = 0 differ between objectives: chance
    of the run, not of the loss.)"""
    batch = make_batch(n=8)
    reference = make_backend(tiny_model_dir)
    with torch.no_grad():
        own = token_logprobs(reference.model, batch.samples)
    batch = dataclasses.replace(
        batch,
        samples=[
            dataclasses.replace(s, behav_logprobs=lp.numpy().astype(np.float32))
            for s, lp in zip(batch.samples, own, strict=True)
        ],
    )
    steps = {}
    for decoupled in (True, False):
        backend = make_backend(tiny_model_dir, decoupled=decoupled, ppo_minibatches=4)
        metrics = backend.train_step(batch)
        steps[decoupled] = metrics, {k: v.clone() for k, v in backend.model.state_dict().items()}
    (dec, dec_w), (naive, naive_w) = steps[True], steps[False]
    assert dec["train/num_minibatches"] == 4 and dec["ppo/clip_fraction"] > 0  # the later minibatches clip
    assert dec["train/prox_behav_abs_diff"] < 1e-5
    for key in ("train/loss", "ppo/clip_fraction", "ppo/ratio_mean", "train/grad_norm"):
        assert dec[key] == pytest.approx(naive[key], rel=1e-4, abs=1e-6), key
    assert max(float((dec_w[k] - naive_w[k]).abs().max()) for k in dec_w) < 1e-5


def test_kl_to_the_reference_is_zero_at_the_start_and_reported(tiny_model_dir):
    """The reference is the initial weights: at the first step θ = ref, so every estimator is 0
    and the loss equals the loss without KL; the entropy is reported."""
    batch = make_batch()
    plain = make_backend(tiny_model_dir).train_step(batch)
    with_kl = make_backend(tiny_model_dir, kl_coef=0.5).train_step(batch)
    assert with_kl["ppo/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert with_kl["train/loss"] == pytest.approx(plain["train/loss"], abs=1e-6)
    assert plain["ppo/entropy"] > 0


def test_entropy_bonus_trains_through_the_entropy(tiny_model_dir):
    """algo.entropy_coef > 0 with every advantage 0: the loss is -coef * (token-mean entropy), and
    only the entropy's gradient can move the weights (with entropy_coef = 0 nothing moves)."""
    batch = make_batch()
    batch.samples = [TrainSample(**{**s.__dict__, "advantage": 0.0}) for s in batch.samples]
    backend = make_backend(tiny_model_dir, entropy_coef=0.05)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    metrics = backend.train_step(batch)
    assert metrics["train/loss"] == pytest.approx(-0.05 * metrics["ppo/entropy"], rel=1e-5)
    assert metrics["train/grad_norm"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in backend.model.state_dict().items())
    still = make_backend(tiny_model_dir)
    assert still.train_step(batch)["train/grad_norm"] == 0.0


def test_offpolicy_metrics_measure_the_pre_step_policy_whatever_the_objective(tiny_model_dir):
    """offpolicy/* compare the behaviour log-probs with the policy as the step begins: the same
    numbers for naive and decoupled PPO (one minibatch: every token measured). Naive PPO's clip
    at its first pass acts exactly on the pre-clipped tokens it cuts (preclip_cut_fraction)."""
    batch = make_batch(n=8)
    naive = make_backend(tiny_model_dir, decoupled=False).train_step(batch)
    decoupled = make_backend(tiny_model_dir, decoupled=True).train_step(batch)
    assert naive["offpolicy/measured_fraction"] == decoupled["offpolicy/measured_fraction"] == 1.0
    for key in [k for k in naive if k.startswith("offpolicy/")]:
        assert naive[key] == pytest.approx(decoupled[key], rel=1e-6, abs=1e-9), key
    assert naive["offpolicy/preclip_fraction"] > 0.5  # behaviour log-probs -5: far from the model's
    assert naive["ppo/clip_fraction"] == pytest.approx(naive["offpolicy/preclip_cut_fraction"], abs=1e-9)


def test_naive_ppo_with_minibatches_measures_its_first_minibatch(tiny_model_dir):
    """No extra forward pass for the metrics: naive PPO knows π_pre only in its first minibatch's
    gradient pass; decoupled PPO (current) has it for every sample."""
    batch = make_batch(n=6)
    naive = make_backend(tiny_model_dir, decoupled=False, ppo_minibatches=3).train_step(batch)
    decoupled = make_backend(tiny_model_dir, decoupled=True, ppo_minibatches=3).train_step(batch)
    assert 0.0 < naive["offpolicy/measured_fraction"] < 1.0
    assert decoupled["offpolicy/measured_fraction"] == 1.0
