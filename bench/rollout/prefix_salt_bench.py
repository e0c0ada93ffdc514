"""What each way of keeping vLLM's prefix cache version-exact under pause_mode=in_place costs
(issue 42 item 6), on one real vLLM server (the bench model, 2 threads), measured once:

- salt: every request carries `cache_salt = "v<version>"`, which vLLM hashes into the prompt's
  first block. No call per update; the figure is the latency of a cold request (no prompt token
  found in the cache, checked on vLLM's hit counter) with a salt beside one without (after a
  reset), medians over `pairs` pairs in alternating order.
- reset: `POST /reset_prefix_cache` after every update.
  * idle server (abort and drain modes already pay it): the call's round trip, median of `calls`;
  * in_place, requests held by `/pause?mode=keep`: the plain reset is refused (`success: false`,
    their blocks are in use); with `reset_running_requests=true` it succeeds by preempting the
    held requests, whose KV is then recomputed. The figures: held requests' wall time to finish
    after resume, with that reset against without (median of `rounds`), the preemptions, and the
    tokens of KV held at the pause: what a preempted request recomputes.

Both drop cross-version prefix reuse alike (the first request of a version recomputes a shared
prefix either way), so that is no difference between them.

Run: `python -m bench.rollout.prefix_salt_bench [--quick]` (needs .venv-vllm: `make vllm-venv`).
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from areal_jobs.api import GenerateRequest
from areal_jobs.config import DataConfig, ModelConfig, RolloutConfig, RolloutEngine
from areal_jobs.data.prompts import eval_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.rollout.server import start_server
from areal_jobs.rollout.vllm_client import generate_body
from areal_jobs.transport.discovery import free_port
from bench.harness import bench_model

HELD = 4  # requests held across the in-place pause
HELD_TOKENS = 256
HELD_PROMPT = 101  # tokens; the last one differs between the held requests  # each generates exactly this many (ignore_eos)
PAUSE_AFTER_TOKENS = 32  # per held request, on average: the pause lands mid-answer


async def _post(session: aiohttp.ClientSession, url: str, body=None, params=None) -> dict:
    async with session.post(url, json=body or {}, params=params) as r:
        r.raise_for_status()
        text = await r.text()
        return {} if not text.strip() else await r.json(content_type=None)


COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",  # prompt tokens looked up (new requests)
    "hits": "vllm:prefix_cache_hits_total",  # of them found in the cache
    "generated": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
}


async def _counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """vLLM's counters from /metrics (summed over label sets)."""
    async with session.get(f"{url}/metrics") as r:
        r.raise_for_status()
        lines = (await r.text()).splitlines()
    return {
        key: sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.split("{")[0].split(" ")[0] == name)
        for key, name in COUNTERS.items()
    }


async def _generate(session, url, ids, max_new, salt="", ignore_eos=False) -> tuple[float, int]:
    body = generate_body(GenerateRequest(f"b-{secrets.token_hex(4)}", ids, max_new, 0.0, cache_salt=salt))
    body["sampling_params"]["ignore_eos"] = ignore_eos
    t0 = time.monotonic()
    out = await _post(session, f"{url}/inference/v1/generate", body)
    return time.monotonic() - t0, len(out["choices"][0]["token_ids"])


async def measure(url: str, api_key: str, prefix: list[int], quick: bool) -> dict[str, float]:
    pairs, calls, rounds = (3, 5, 1) if quick else (15, 20, 3)
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as s:

        async def reset() -> None:
            for _ in range(50):  # refused while a finished request still holds its blocks
                if (await _post(s, f"{url}/reset_prefix_cache")).get("success", True):
                    return
                await asyncio.sleep(0.05)
            raise RuntimeError("the prefix cache could not be reset on an idle server")

        async def cold(salt: str) -> float:
            """One request whose whole prompt is a cache miss (checked on the hit counter)."""
            if not salt:
                await reset()
            before = await _counters(s, url)
            elapsed, _ = await _generate(s, url, prefix, 8, salt=salt)
            await asyncio.sleep(0.3)  # its step's stats reach /metrics
            assert (await _counters(s, url))["hits"] == before["hits"], "not a cold request"
            return elapsed

        await _generate(s, url, prefix, 8)  # warm-up
        salted, plain = [], []
        for i in range(pairs):  # alternating order: machine load hits both alike
            for salt in (f"s{i}", "") if i % 2 == 0 else ("", f"s{i}"):
                (salted if salt else plain).append(await cold(salt))
        reset_s = []
        for _ in range(calls):
            t0 = time.monotonic()
            await reset()
            reset_s.append(time.monotonic() - t0)

        async def held_round(forced: bool) -> tuple[float, bool, float, float, float]:
            """HELD answers, paused in place mid-answer. Returns their wall time after resume,
            whether a plain reset succeeded while they were held, the forced reset's seconds, the
            tokens of KV they held at the pause (prompts + tokens generated so far), and the
            preemptions after it (a preempted request recomputes all of its KV: vLLM preempts by
            recompute, and the reset cache has nothing left to hit)."""
            start = await _counters(s, url)
            tasks = [
                asyncio.create_task(
                    _generate(s, url, prefix[: HELD_PROMPT - 1] + [i + 5], HELD_TOKENS, ignore_eos=True)
                )
                for i in range(HELD)
            ]
            for _ in range(600):  # bounded: pause once every request is some way into its answer
                if (await _counters(s, url))["generated"] - start["generated"] >= HELD * PAUSE_AFTER_TOKENS:
                    break
                await asyncio.sleep(0.05)
            await _post(s, f"{url}/pause", params={"mode": "keep", "clear_cache": "false"})
            await asyncio.sleep(0.3)  # the last step's stats reach /metrics
            held_kv = HELD * HELD_PROMPT + (await _counters(s, url))["generated"] - start["generated"]
            plain_ok = (await _post(s, f"{url}/reset_prefix_cache")).get("success", True)
            forced_s = 0.0
            if forced:
                t0 = time.monotonic()
                out = await _post(s, f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
                forced_s = time.monotonic() - t0
                assert out.get("success") is not False, out
            before = await _counters(s, url)
            t0 = time.monotonic()
            await _post(s, f"{url}/resume")
            done = await asyncio.gather(*tasks)
            elapsed = time.monotonic() - t0
            assert all(n == HELD_TOKENS for _, n in done), done
            await asyncio.sleep(0.5)  # the last step's stats reach /metrics
            after = await _counters(s, url)
            return elapsed, bool(plain_ok), forced_s, held_kv, after["preemptions"] - before["preemptions"]

        kept, forced_rounds = [], []
        for _ in range(rounds):
            kept.append(await held_round(False))
            forced_rounds.append(await held_round(True))
    return {
        "prefix_salt/prompt_tokens": float(len(prefix)),
        "prefix_salt/cold_request_salted_s": statistics.median(salted),
        "prefix_salt/cold_request_unsalted_s": statistics.median(plain),
        "prefix_salt/reset_idle_s": statistics.median(reset_s),
        "prefix_salt/reset_refused_while_held": float(sum(not r[1] for r in kept + forced_rounds)),
        "prefix_salt/held_rounds": float(len(kept + forced_rounds)),
        "prefix_salt/held_finish_keep_s": statistics.median(r[0] for r in kept),
        "prefix_salt/held_finish_after_forced_reset_s": statistics.median(r[0] for r in forced_rounds),
        "prefix_salt/forced_reset_call_s": statistics.median(r[2] for r in forced_rounds),
        # what the forced reset makes the held requests recompute (keep recomputes nothing)
        "prefix_salt/held_kv_tokens_at_pause": statistics.median(r[3] for r in kept + forced_rounds),
        "prefix_salt/preemptions_keep": statistics.median(r[4] for r in kept),
        "prefix_salt/preemptions_forced_reset": statistics.median(r[4] for r in forced_rounds),
    }


def run(quick: bool = False) -> dict[str, float]:
    model_dir = bench_model()
    tok = load_tokenizer(str(model_dir))
    prefix = [t for p in eval_prompts(DataConfig(num_eval_prompts=32), tok.encode) for t in p.input_ids][:384]
    rollout = RolloutConfig(engine=RolloutEngine.vllm, server_threads=2, kv_cache_gib=0.5)
    with tempfile.TemporaryDirectory(prefix="bench_prefix_salt_") as tmp:
        server = start_server(
            str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, ModelConfig(),
            Path(tmp) / "vllm.log", seed=0,
        )  # fmt: skip
        try:
            server.wait_healthy(timeout_s=600)
            return asyncio.run(measure(server.url, server.api_key, prefix, quick))
        finally:
            server.stop()


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv).items():
        print(f"{name}\t{value:.4f}")
