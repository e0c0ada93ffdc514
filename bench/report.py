"""Markdown for bench/results.json: one headline table across sections, then one table per section.
Pure: a results dict in, text out."""

from __future__ import annotations

# (section, metric key, label, format) for the headline table; a missing key is skipped
HEADLINE: list[tuple[str, str, str, str]] = [
    ("e2e", "e2e/async_tokens_per_s", "default async (eta=4) trained tokens/s, median", "{:,.0f}"),
    ("e2e", "e2e/sync_tokens_per_s", "sync (eta=0, same processes) trained tokens/s, median", "{:,.0f}"),
    ("e2e", "e2e/colocated_tokens_per_s", "colocated sync trained tokens/s, median", "{:,.0f}"),
    ("e2e", "e2e/async_over_sync", "default async / sync, median over rounds", "{:.2f}x"),
    ("e2e", "e2e/ideal_overlap_bound", "ideal overlap bound (T_gen + T_train) / max, median", "{:.2f}x"),
    ("e2e", "e2e/async_over_sync_share_of_bound", "default async / sync as a share of the bound", "{:.0%}"),
    ("e2e", "e2e/async_over_colocated", "default async / colocated sync, median", "{:.2f}x"),
    ("e2e", "e2e/load_mean", "load average during the e2e runs (mean)", "{:.1f}"),
    ("pause", "pause/abort_gen_tokens_per_s", "gen tokens/s under updates: abort (resubmit)", "{:,.0f}"),
    ("pause", "pause/in_place_gen_tokens_per_s", "gen tokens/s under updates: in_place (keep KV)", "{:,.0f}"),
    ("pause", "pause/drain_gen_tokens_per_s", "gen tokens/s under updates: drain", "{:,.0f}"),
    ("reward_overhead", "reward_overhead/on_over_off", "gen tokens/s, rewards on / off", "{:.3f}"),
    ("weight_sync", "weight_sync/tiny_s", "weight sync, bench model to SGLang: s", "{:.3f}"),
    ("weight_sync", "weight_sync/tiny_gb_per_s", "weight sync, bench model to SGLang: GB/s", "{:.3f}"),
    ("weight_sync", "weight_sync/gloo_s", "gloo broadcast of the payload: s", "{:.2f}"),
    ("weight_sync", "weight_sync/gloo_gb_per_s", "gloo broadcast: GB/s", "{:.2f}"),
    ("weight_sync", "weight_sync/memcpy_gb_per_s", "memcpy: GB/s", "{:.2f}"),
    ("weight_delta", "weight_delta/sglang_full_update_s", "bf16 SGLang update, full copy: s", "{:.3f}"),
    ("weight_delta", "weight_delta/sglang_delta_update_s", "bf16 SGLang update, delta: s", "{:.3f}"),
    ("weight_delta", "weight_delta/vllm_full_update_s", "bf16 vLLM update, full copy: s", "{:.3f}"),
    ("weight_delta", "weight_delta/vllm_delta_update_s", "bf16 vLLM update, delta: s", "{:.3f}"),
    (
        "weight_delta",
        "weight_delta/builtin_changed_share_mean",
        "bf16 values changed per step, bench model",
        "{:.1%}",
    ),
    (
        "weight_delta",
        "weight_delta/smollm2_changed_share_mean",
        "bf16 values changed per step, SmolLM2 @1e-6",
        "{:.2%}",
    ),
    (
        "weight_delta",
        "weight_delta/smollm2_full_over_delta_bytes",
        "full / delta bytes, SmolLM2 @1e-6",
        "{:.1f}x",
    ),
    ("packing", "packing/task_nonpad_share_packed", "non-padding share, packed (task)", "{:.1%}"),
    ("packing", "packing/task_nonpad_share_padded", "non-padding share if padded (task)", "{:.1%}"),
    (
        "packing",
        "packing/paper_imbalance_balanced",
        "micro-batch imbalance max/mean, balanced (paper lengths)",
        "{:.3f}",
    ),
    (
        "packing",
        "packing/paper_imbalance_naive",
        "micro-batch imbalance max/mean, naive (paper lengths)",
        "{:.3f}",
    ),
    ("packing", "packing/task_imbalance_balanced", "micro-batch imbalance, balanced (task)", "{:.3f}"),
    ("packing", "packing/task_imbalance_naive", "micro-batch imbalance, naive (task)", "{:.3f}"),
    (
        "controller",
        "controller/completed_requests_per_s",
        "controller ceiling: requests/s completed",
        "{:,.0f}",
    ),
    (
        "controller",
        "controller/admitted_requests_per_s",
        "controller ceiling: requests/s admitted",
        "{:,.0f}",
    ),
    ("controller", "transport/messages_per_s", "ZeroMQ trajectory messages/s", "{:,.0f}"),
    ("controller", "transport/mb_per_s", "ZeroMQ trajectory MB/s", "{:,.1f}"),
    ("reward", "reward/math_per_s", "rewards/s: math (numeric)", "{:,.0f}"),
    ("reward", "reward/math_symbolic_per_s", "rewards/s: math (symbolic)", "{:,.1f}"),
    ("reward", "reward/code_per_s", "rewards/s: code (sandboxed)", "{:,.1f}"),
    ("reward_model", "reward_model/answers_per_s", "reward-model answers/s per server (batch 16)", "{:,.1f}"),
    ("reward_model", "reward_model/batching_gain", "reward-model answers/s, batch 16 / batch 1", "{:.2f}x"),
    ("trainer", "trainer/torch_tokens_per_s", "trainer tokens/s: torch backend", "{:,.0f}"),
    ("trainer", "trainer/megatron_tokens_per_s", "trainer tokens/s: Megatron (CPU, TP=1)", "{:,.0f}"),
    (
        "trainer_memory",
        "trainer_memory/megatron_after_32k_peak_gib",
        "Megatron step peak at 32k tokens/micro-batch, vocab 152k (CPU): GiB",
        "{:.2f}",
    ),
    (
        "trainer_memory",
        "trainer_memory/megatron_after_bytes_per_token",
        "Megatron step peak per token, 8k -> 32k (CPU): bytes",
        "{:,.0f}",
    ),
]


def headline_table(results: dict) -> str:
    sections = results.get("sections", {})
    lines = ["| section | measure | value |", "|---|---|---:|"]
    for section, key, label, fmt in HEADLINE:
        value = sections.get(section, {}).get(key)
        if value is not None:
            lines.append(f"| {section} | {label} | {fmt.format(value)} |")
    for section, error in results.get("errors", {}).items():
        lines.append(f"| {section} | FAILED | {error.splitlines()[0][:80]} |")
    return "\n".join(lines)


def section_table(name: str, metrics: dict[str, float]) -> str:
    lines = [f"### {name}", "", "| metric | value |", "|---|---:|"]
    for key, value in metrics.items():
        lines.append(f"| `{key}` | {value:.4g} |")
    return "\n".join(lines)


E2E_PHASES = [  # (breakdown key, column) of the per-step table
    ("steps", "measured steps"), ("tokens_per_s", "tokens/s"), ("step_s", "step s"),
    ("gen_wait_s", "gen wait s"), ("train_s", "train s"), ("publish_s", "publish s"),
    ("pause_s", "pause s"), ("broadcast_s", "broadcast s"), ("load_resume_s", "load+resume s"),
    ("reprefill_tokens", "re-prefill tokens/step"), ("reprefill_s_est", "re-prefill s (est.)"),
    ("load_mean", "load avg"),
]  # fmt: skip


def e2e_tables(metrics: dict[str, float]) -> str:
    """Per mode, where a step's time goes (medians over rounds); per ratio, median and spread."""
    modes = [k.removeprefix("e2e/").removesuffix("_step_s") for k in metrics if k.endswith("_step_s")]
    if not modes:
        return ""
    lines = [
        "### e2e: per step (median over rounds)",
        "",
        "| mode | " + " | ".join(c for _, c in E2E_PHASES) + " |",
    ]
    lines.append("|---|" + "---:|" * len(E2E_PHASES))
    for mode in modes:
        cells = [metrics.get(f"e2e/{mode}_{key}") for key, _ in E2E_PHASES]
        lines.append(f"| {mode} | " + " | ".join("-" if v is None else f"{v:.4g}" for v in cells) + " |")
    ratios = [k.removeprefix("e2e/").removesuffix("_median") for k in metrics if k.endswith("_median")]
    lines += [
        "",
        "### e2e: ratios over rounds",
        "",
        "| ratio | median | min | max | spread |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in ratios:
        vals = [metrics[f"e2e/{r}_{s}"] for s in ("median", "min", "max")]
        lines.append(
            f"| {r} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {metrics[f'e2e/{r}_spread']:.1%} |"
        )
    return "\n".join(lines)


def markdown(results: dict) -> str:
    m = results.get("machine", {})
    mode = "quick" if results.get("quick") else "full"
    head = (
        f"## make bench ({mode}): {m.get('cpus', '?')} CPUs, load average {m.get('load_start', '?')} at start, "
        f"{m.get('load_end', '?')} at end, {results.get('wall_s', 0):.0f} s"
    )
    parts = [head, headline_table(results)]
    if "e2e" in results.get("sections", {}):
        parts.append(e2e_tables(results["sections"]["e2e"]))
    if "trainer_memory" in results.get("sections", {}):
        from bench.trainer.trainer_memory_bench import table

        parts.append(table(results["sections"]["trainer_memory"]))
    for name, metrics in results.get("sections", {}).items():
        parts.append(section_table(name, metrics))
    return "\n\n".join(parts) + "\n"
