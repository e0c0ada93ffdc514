"""The behaviour log-probs are of the distribution that sampled, softmax(logits / temperature),
on both engines; a top-p nucleus (which no side of the loss would model alike) is refused."""

import pytest

from areal_jobs.config import DType, RolloutConfig, RolloutEngine
from areal_jobs.rollout.server import sglang_env
from areal_jobs.rollout.vllm_server import vllm_command


def test_top_p_below_one_is_refused_naming_the_override():
    with pytest.raises(ValueError, match=r"rollout\.top_p=0\.9.*set rollout\.top_p=1\.0"):
        RolloutConfig(top_p=0.9)
    assert RolloutConfig(temperature=0.7).top_p == 1.0


def test_sglang_returns_tempered_logprobs_even_when_the_environment_says_otherwise(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    for cpu in (True, False):
        assert sglang_env("key", cpu, threads=1)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


def test_vllm_returns_processed_logprobs():
    cmd = vllm_command("/p", "/m", "h", 1, RolloutConfig(engine=RolloutEngine.vllm), DType.bfloat16, False, 0)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
