"""Peak memory of the trainer's log-prob computation, full-vocabulary (before) vs chunked (after).

One forward+backward of the torch backend's `token_logprobs` (the path every HF backend trains
through: packed forward, LM head, log-probs and entropy, backward into every weight) on a Qwen2
of width 64 with 2 layers and the real vocabulary (151,936, tied embeddings, random weights),
4 packed sequences, at 1k/2k/4k/8k tokens (quick: 1k/2k), with `trainer.logprob_chunk_tokens`
0 (the full-vocabulary path, as before) and 1024 (the default). Also the LM head alone
(`hf_logprobs.packed_head_logprobs` on random hidden states: log-probs and entropy, backward
into the hidden states and the weight), which is what chunking changes, chunked up to 32k tokens;
the rest of the whole-path figure is the model's own activations and attention (issue 25 item 2,
elsewhere). A point that dies (out of memory: the full-vocabulary path at 8k tokens needs over
12 GB) is reported as missing and ends its series.

Each point runs in a fresh spawned process (one torch thread): the peak is the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs just before the measured call) minus
its resident set just before it, i.e. what the computation adds above the model and the inputs.
Bytes per token = that peak / tokens; the slope is the least-squares fit over the points.
CPU only, nothing timed is asserted: `python -m bench.trainer.logprob_memory_bench [--quick]`.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

VOCAB = 151_936  # Qwen2's
WIDTH, LAYERS = 64, 2
CHUNK = 1024  # trainer.logprob_chunk_tokens default
TIMEOUT_S = 900.0


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def _model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16_384,
        tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float().train()


def _samples(num_tokens: int):
    """4 sequences of num_tokens / 4, prompts of 16 tokens (the outputs are what is scored)."""
    import numpy as np

    from areal_jobs.trainer.intake.batch import TrainSample

    rng = np.random.default_rng(0)
    n = num_tokens // 4
    return [
        TrainSample(f"s{i}", rng.integers(1, VOCAB, n), 16, np.zeros(n - 16, np.float32),
                    np.zeros(n - 16, np.int32), 1.0, 0.0)
        for i in range(4)
    ]  # fmt: skip


def _measure(what: str, num_tokens: int, chunk: int, conn) -> None:
    try:
        conn.send(_measure_here(what, num_tokens, chunk))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send({"error": repr(e)})


def _measure_here(what: str, num_tokens: int, chunk: int) -> dict[str, float]:
    """Child process: build, warm up on 256 tokens, then one measured forward+backward."""
    import numpy as np
    import torch

    from areal_jobs.trainer.forward.hf_logprobs import packed_head_logprobs, token_logprobs

    torch.set_num_threads(1)
    model = _model()
    if what == "whole":

        def step(tokens: int) -> None:
            logp, entropy = token_logprobs(model, _samples(tokens), with_entropy=True, chunk_tokens=chunk)
            (torch.cat(logp).sum() + torch.cat(entropy).sum()).backward()
    else:  # the same LM-head half of token_logprobs on random hidden states: no model forward
        weight = model.get_output_embeddings().weight

        def step(tokens: int) -> None:
            samples = _samples(tokens)
            hidden = torch.randn(tokens, WIDTH, requires_grad=True)
            ids = torch.from_numpy(np.concatenate([s.input_ids for s in samples]))
            starts = [i * (tokens // 4) for i in range(4)]
            logp, entropy = packed_head_logprobs(
                hidden, weight, ids, samples, starts, temperature=1.0, chunk_tokens=chunk
            )
            (torch.cat(logp).sum() + torch.cat(entropy).sum()).backward()

    step(256)  # lazy initialisation and allocator warm-up stay out of the measurement
    model.zero_grad(set_to_none=False)  # the gradient buffers exist before, as in training
    import gc

    gc.collect()
    before = _status_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    step(num_tokens)
    elapsed = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"peak_bytes": (peak - before) * 1024, "seconds": elapsed}


def measure_point(what: str, num_tokens: int, chunk: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_measure, args=(what, num_tokens, chunk, child))
    proc.start()
    name = f"{what} at {num_tokens} tokens, chunk {chunk}"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not parent.poll(5.0):
            if proc.exitcode is not None:  # killed (out of memory) without a word
                raise RuntimeError(f"{name}: the process died (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: no result in {TIMEOUT_S} s")
        result = parent.recv()
        if "error" in result:
            raise RuntimeError(f"{name}: {result['error']}")
        return result
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def _slope(points: list[tuple[int, float]]) -> float:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def run(quick: bool = False) -> dict[str, float]:
    sizes = {  # (what, chunked) -> token counts
        ("head", False): [1024, 2048, 4096, 8192],
        ("head", True): [1024, 2048, 4096, 8192, 16384, 32768],
        ("whole", False): [1024, 2048, 4096, 8192],
        ("whole", True): [1024, 2048, 4096, 8192],
    }
    out: dict[str, float] = {}
    for what in ("head", "whole"):
        for label, chunk in (("before", 0), ("after", CHUNK)):
            points = []
            for tokens in [1024, 2048] if quick else sizes[what, chunk > 0]:
                try:
                    r = measure_point(what, tokens, chunk)
                except RuntimeError as e:
                    print(f"{what} {label} {tokens}: {e}", file=sys.stderr, flush=True)
                    break
                print(f"{what} {label} {tokens}: {r['peak_bytes'] / 2**30:.3f} GiB, {r['seconds']:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
                points.append((tokens, r["peak_bytes"]))
                key = f"logprob_memory/{what}_{label}_{tokens}"
                out[f"{key}_peak_gib"] = r["peak_bytes"] / 2**30
                out[f"{key}_bytes_per_token"] = r["peak_bytes"] / tokens
                out[f"{key}_s"] = r["seconds"]
            if len(points) > 1:
                out[f"logprob_memory/{what}_{label}_slope_bytes_per_token"] = _slope(points)
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.6g}")
