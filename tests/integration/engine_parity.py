"""What the SGLang and vLLM tests check the same way: the trainer's model beside a server's answers.

One definition of "the server's log-probs match the trainer's" (`server_trainer_gap`, `PARITY`), of
the trainer's greedy answer, and of the prompts, for full weights and LoRA on both engines.
"""

from __future__ import annotations

import numpy as np
import torch

from areal_jobs.api import RewardResult
from areal_jobs.config import AlgoConfig, DataConfig, DType, LoraConfig, TrainerConfig
from areal_jobs.data.prompts import eval_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.trainer.forward import lora
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.intake.batch import TrainSample
from areal_jobs.trainer.torch.backend import TorchBackend

# |server - trainer| per generated token, float32 on CPU: mean, max. Tight enough that the base
# model beside an adapted server (or an untempered reference) fails it by 20x or more.
PARITY = (1e-3, 1e-2)


def trainer(
    model_dir, lora_config: LoraConfig | None = None, adapter_seed: int | None = None
) -> TorchBackend:
    """The torch trainer in eval mode; with `adapter_seed`, its LoRA B matrices are random (a policy
    that differs from the base, which zero-initialised adapters would not)."""
    backend = TorchBackend(TrainerConfig(), AlgoConfig(), str(model_dir), DType.float32, lora_config)
    backend.setup()
    if adapter_seed is not None:
        gen = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for layer in lora.lora_layers(backend.model):
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.05)
    backend.model.eval()
    return backend


def prompts(model_dir, n: int) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    return [p.input_ids for p in eval_prompts(DataConfig(num_eval_prompts=n), tok.encode)]


def samples_of(inputs, responses) -> list[TrainSample]:
    """The server's answers as training samples (behaviour log-probs = the server's)."""
    return [
        TrainSample(
            f"s{i}",
            np.array(p + r.output_ids),
            len(p),
            np.array(r.logprobs, dtype=np.float32),
            np.zeros(len(r.output_ids), dtype=np.int32),
            0.0,
            0.0,
        )  # fmt: skip
        for i, (p, r) in enumerate(zip(inputs, responses, strict=True))
        if r.output_ids
    ]


def server_trainer_gap(model, inputs, responses) -> np.ndarray:
    """|trainer - server| log-prob per output token, the trainer's through `token_logprobs` (the
    loss's own path: packed, chunked head)."""
    samples = samples_of(inputs, responses)
    with torch.no_grad():
        recomputed = torch.cat(token_logprobs(model, samples)).numpy()
    return np.abs(recomputed - np.concatenate([s.behav_logprobs for s in samples]))


def assert_parity(gap: np.ndarray) -> None:
    assert gap.size > 50, f"only {gap.size} tokens compared"
    assert gap.mean() < PARITY[0] and gap.max() < PARITY[1], (gap.mean(), gap.max())


def logprob_gaps(model, inputs, responses, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """|server - reference| per output token, the reference computed here from the same HF model
    one sequence at a time: log_softmax(logits / temperature) (the distribution that sampled),
    and log_softmax(logits) (the untempered model). Responses without tokens are skipped."""
    tempered, untempered = [], []
    with torch.no_grad():
        for prompt, r in zip(inputs, responses, strict=True):
            if not r.output_ids:
                continue
            ids = torch.tensor([list(prompt) + list(r.output_ids)])
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
            target = torch.tensor(r.output_ids)[:, None]
            served = torch.tensor(r.logprobs, dtype=torch.float32)
            for scale, out in ((temperature, tempered), (1.0, untempered)):
                ref = torch.log_softmax(logits / scale, dim=-1).gather(-1, target)[:, 0]
                out.append((ref - served).abs().numpy())
    return np.concatenate(tempered), np.concatenate(untempered)


def hf_greedy(backend: TorchBackend, ids: list[int], max_new_tokens: int) -> list[int]:
    """The trainer's own greedy answer (HF generate; token 0 ends it, as the tiny model's EOS)."""
    with torch.no_grad():
        out = backend.model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=0,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


class ZeroScorer:
    """A reward of 0 for every answer: controller tests about versions and interruption."""

    async def score_group(self, requests):
        return [RewardResult(0.0) for _ in requests]

    def metrics(self):
        return {}
