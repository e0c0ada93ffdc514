"""The committed tool-use warm start (areal_jobs/tasks/models/builtin_model_tools): the default ToolRecipe on
the committed base, the base's tokenizer byte for byte, the misconception kept, and calls rare but
possible, the behaviour RL on tool_arith amplifies. Read off the logits: seconds on CPU."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from areal_jobs.tasks import arith_task
from areal_jobs.tasks.warm_start import fact_probe
from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR, TinyRecipe
from areal_jobs.tasks.warm_start.tool_warm_start import TOOLS_DIR, ToolRecipe, call_probabilities


@pytest.fixture(scope="module")
def probed() -> tuple[dict, list[fact_probe.FactBelief]]:
    """(call probability per fact, belief per fact) of the committed tools model."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = fact_probe.load(TOOLS_DIR)
        return call_probabilities(*loaded), fact_probe.probe(*loaded)
    finally:
        torch.set_num_threads(threads)


def test_committed_tools_model_is_the_default_recipe_on_the_committed_base() -> None:
    built = json.loads((TOOLS_DIR / "build.json").read_text())
    assert built["recipe"] == asdict(ToolRecipe()), (
        "rebuild: python -m areal_jobs.tasks.warm_start.tool_warm_start"
    )
    assert built["base"] == asdict(TinyRecipe())
    # the same token ids for every text: prompts, stop tokens and answers mean the same in both
    assert (TOOLS_DIR / "tokenizer.json").read_bytes() == (PACKAGED_DIR / "tokenizer.json").read_bytes()


def test_calls_are_rare_but_possible(probed) -> None:
    calls = probed[0]
    assert len(calls) == 60
    mean = sum(calls.values()) / len(calls)
    assert 0.02 < mean < 0.3, mean  # greedy never calls; sampling does, at some steps of most answers
    assert min(calls.values()) > 0.005, min(calls.items(), key=lambda kv: kv[1])


def test_the_written_digits_keep_the_misconception(probed) -> None:
    beliefs = probed[1]
    misconceived = [b for b in beliefs if b.misconception]
    wrong_way = sum(b.greedy == arith_task.misconceived(b.value, b.sign, b.operand) for b in misconceived)
    assert wrong_way >= 15, wrong_way
    others = [b for b in beliefs if not b.misconception]
    assert sum(b.greedy == b.right for b in others) >= len(others) - 2
