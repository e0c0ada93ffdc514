"""The pure parts of the vLLM engine: the request body, response parsing (recorded payload shapes), the launch command
and environment, the pause-mode mapping, the API-key middleware, and the engine registry."""

from __future__ import annotations

import asyncio
import sys

import pytest

from areal_jobs.api import FinishReason, GenerateRequest, RolloutEngineClient
from areal_jobs.config import DType, RolloutConfig, RolloutEngine
from areal_jobs.rollout.engines import make_client
from areal_jobs.rollout.sglang_client import SGLangClient
from areal_jobs.rollout.vllm_auth import RequireApiKey
from areal_jobs.rollout.vllm_client import PAUSE_MODES, VLLMClient, generate_body, parse_generate
from areal_jobs.rollout.vllm_server import vllm_command, vllm_env, vllm_python


def payload(tokens, logprobs, finish="stop", spans=(("default", 0, None),)):
    return {
        "request_id": "generate-tokens-x",
        "choices": [
            {
                "index": 0,
                "token_ids": tokens,
                "finish_reason": finish,
                "logprobs": {
                    "content": [
                        {"token_id": t, "logprob": lp, "top_logprobs": []} for t, lp in zip(tokens, logprobs)
                    ]
                },
                "weight_versions": [
                    {"version": v, "start": s, "end": len(tokens) if e is None else e} for v, s, e in spans
                ],
            }
        ],
    }


def test_generate_body_carries_the_version_salt_and_the_sampling_params():
    """The controller's prefix-cache namespace `v<version>` reaches vLLM's token route, which hashes
    it into the prompt's first block (issue 42: without it a request reused KV of older weights)."""
    request = GenerateRequest("r.0", [1, 2, 3], 8, temperature=0.001, seed=5, stop_token_ids=(0,),
                              stop=("\n",), cache_salt="v7")  # fmt: skip
    body = generate_body(request)
    assert body["cache_salt"] == "v7"
    assert body["request_id"] == "r.0" and body["token_ids"] == [1, 2, 3] and body["output_mode"] == "tokens"
    assert body["sampling_params"] == {
        "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "logprobs": 0, "seed": 5,
        "stop_token_ids": [0], "stop": ["\n"], "include_stop_str_in_output": True,
    }  # fmt: skip
    # no salt asked for: none sent (vLLM refuses an empty one)
    assert "cache_salt" not in generate_body(GenerateRequest("r.1", [1], 4))


def test_parse_generate_reads_tokens_logprobs_finish_and_the_oldest_version():
    r = parse_generate(payload([5, 6, 0], [-0.1, -0.2, -0.3], "stop", (("3", 0, 2), ("4", 2, None))))
    assert r.output_ids == [5, 6, 0] and r.logprobs == [-0.1, -0.2, -0.3]
    assert r.finish_reason is FinishReason.stop and r.weight_version == 3
    assert parse_generate(payload([7], [-1.0], "abort")).finish_reason is FinishReason.abort
    assert parse_generate(payload([7], [-1.0], "length")).weight_version == 0  # "default" = start
    assert parse_generate(payload([], [], "abort", ())).weight_version == -1  # no token: client fills in


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (lambda p: p["choices"][0]["logprobs"]["content"].pop(), "log-probs"),
        (lambda p: p["choices"][0]["logprobs"]["content"][0].update(token_id=99), "do not match"),
        (lambda p: p["choices"][0].update(finish_reason="error"), "finish_reason"),
        (lambda p: p["choices"].append(p["choices"][0]), "one choice"),
    ],
)
def test_parse_generate_refuses_inconsistent_payloads(bad, fragment):
    p = payload([5, 6], [-0.1, -0.2])
    bad(p)
    with pytest.raises(ValueError, match=fragment):
        parse_generate(p)


def test_every_pause_mode_maps_to_a_vllm_mode():
    from areal_jobs.config import PauseMode

    assert {m.value for m in PauseMode} == set(PAUSE_MODES)
    assert PAUSE_MODES == {"abort": "abort", "in_place": "keep", "drain": "wait"}
    client = VLLMClient("0", "http://127.0.0.1:1", "k", generate_timeout_s=1, call_timeout_s=1)
    with pytest.raises(ValueError, match="unknown pause mode"):
        asyncio.run(client.pause("retract"))


def test_command_runs_the_api_server_with_our_extension_and_no_key_on_the_command_line():
    rollout = RolloutConfig(engine=RolloutEngine.vllm, tp_size=2, kv_cache_gib=0.5, extra_server_args=["--x"])
    cmd = vllm_command("/v/bin/python", "/m", "127.0.0.1", 8100, rollout, DType.float32, True, 7)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in (
        "--model /m", "--port 8100", "--tensor-parallel-size 2", "--seed 7", "--enforce-eager",
        "--worker-extension-cls areal_jobs.rollout.vllm_worker.BroadcastWeightReceiver",
        "--middleware areal_jobs.rollout.vllm_auth.RequireApiKey", "--enable-scale-out",
        f"--kv-cache-memory-bytes {1 << 29}", "--dtype float32", "--logprobs-mode processed_logprobs",
    ):  # fmt: skip
        assert part in joined, part
    assert cmd[-1] == "--x" and "--api-key" not in cmd
    gpu = vllm_command("/p", "/m", "h", 1, rollout, DType.bfloat16, False, 0)
    assert "--enforce-eager" not in gpu and "--kv-cache-memory-bytes" not in gpu


def test_env_carries_the_key_the_rl_routes_and_the_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = vllm_env("secret", cpu=True, threads=3)
    assert env["VLLM_API_KEY"] == "secret" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    repo, rest = env["PYTHONPATH"].split(":", 1)
    assert (__import__("pathlib").Path(repo) / "areal_jobs" / "rollout" / "vllm_worker.py").exists()
    assert rest == "/elsewhere"


def test_engine_python_prefers_the_config_then_the_job_env(monkeypatch):
    monkeypatch.setenv("AREAL_ENGINE_PYTHON", "/job/venv/bin/python")
    assert vllm_python(RolloutConfig(engine_python="/cfg/python")) == "/cfg/python"
    assert vllm_python(RolloutConfig()) == "/job/venv/bin/python"
    monkeypatch.delenv("AREAL_ENGINE_PYTHON")
    assert vllm_python(RolloutConfig()) in (
        sys.executable,
        str(__import__("areal_jobs.rollout.vllm_server").rollout.vllm_server.VENV_PYTHON),
    )


def test_registry_gives_each_engine_its_client_and_both_satisfy_the_protocol():
    for engine, cls in ((RolloutEngine.sglang, SGLangClient), (RolloutEngine.vllm, VLLMClient)):
        client = make_client(engine, "0", "http://127.0.0.1:1", "k", generate_timeout_s=1, call_timeout_s=1)
        assert type(client) is cls and isinstance(client, RolloutEngineClient)


def asgi_call(app, headers):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    scope = {"type": "http", "path": "/collective_rpc", "method": "POST", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def test_middleware_guards_every_path(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    app = RequireApiKey(inner)
    assert asgi_call(app, [])[0]["status"] == 401
    assert asgi_call(app, [(b"authorization", b"Bearer k2")])[0]["status"] == 401
    assert asgi_call(app, [(b"authorization", b"Bearer k1")]) == [] and reached == ["/collective_rpc"]
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        RequireApiKey(inner)
