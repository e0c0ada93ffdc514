"""One episode's tokens as the controller holds them: what a checkpoint saves and a resume replays.

    prompt [p] ─▶ output_ids [n]: model turns and environment tokens, back to back
                  logprobs   [n]  behaviour log-prob of each model token; 0.0 on environment tokens
                  versions   [n]  policy version each model token was sampled under; environment
                                  tokens get the version current when they were appended
                  loss_mask  [n]  1 on model tokens, 0 on environment / user / tool tokens
                  events          ["model" | "env" | "tool", start, end, extra], in order
                  routes          the engine's expert routes (trainer.routing_replay=rollout): JSON
                                  segments over prompt + output positions (transport/routes.py)

`events` is the episode's recording: a model event spans one turn's tokens (extra: its finish
reason, "" while the turn is being generated), an env event spans appended tokens (extra ""), a
tool event spans nothing (start == end) and records the call (extra: {"name", "arguments",
"result"}). A workflow re-run on a restored state replays them (context.py).

An environment token's version is the controller's version when it was appended, which is >= the
version of every model token before it, so the oldest *model* token of an episode decides its
freshness (messages.TrajectoryGroup.oldest_version reads versions where loss_mask is 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_jobs.api import ExpertRoutes
from areal_jobs.transport.routes import add_segment

MODEL, ENV, TOOL = "model", "env", "tool"


@dataclass
class EpisodeState:
    """One sample of a group, from admission to its reward. Plain JSON types only (checkpoints)."""

    sample_id: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    interruptions: int = 0  # weight updates that interrupted one of its turns
    finish_reason: str = ""  # of the latest model turn: "stop" | "length"; "" before any ended
    events: list[list] = field(default_factory=list)
    num_turns: int = 0  # model events recorded
    num_tool_calls: int = 0  # tool events recorded
    reward: float = 0.0
    reward_status: str = ""  # api.RewardStatus value or "error"; "" until the episode has its reward
    routes: list[list] = field(default_factory=list)  # transport/routes.py's JSON segments; [] = none

    def __post_init__(self) -> None:
        # a state built from tokens alone (unit tests, evaluation) is one model turn in progress
        if self.output_ids and not self.events:
            self.events = [[MODEL, 0, len(self.output_ids), self.finish_reason]]
            self.num_turns = 1
        if len(self.loss_mask) < len(self.output_ids):
            self.loss_mask += [1] * (len(self.output_ids) - len(self.loss_mask))

    @property
    def done(self) -> bool:
        """The workflow returned (or failed with EpisodeError): nothing left to generate."""
        return self.reward_status != ""

    # ------------------------------------------------------------------ model turns

    def open_turn(self) -> int:
        """Start of the model turn in progress, opening one at the end of the tokens if none is."""
        if self.events and self.events[-1][0] == MODEL and self.events[-1][3] == "":
            return self.events[-1][1]
        self.events.append([MODEL, len(self.output_ids), len(self.output_ids), ""])
        self.num_turns += 1
        return len(self.output_ids)

    def add_model_tokens(
        self, token_ids: list[int], logprobs: list[float], version: int, routes: ExpertRoutes | None = None
    ) -> None:
        """One segment of the turn in progress (open_turn first); `routes`: its request's expert
        routes (positions of prompt + output), kept only past what earlier segments covered."""
        assert self.events and self.events[-1][0] == MODEL and self.events[-1][3] == "", "no open turn"
        assert len(token_ids) == len(logprobs), "one log-prob per token"
        self.output_ids += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        self.loss_mask += [1] * len(token_ids)
        self.events[-1][2] = len(self.output_ids)
        if routes is not None:
            add_segment(self.routes, routes)

    def close_turn(self, finish_reason: str) -> str:
        assert finish_reason, "a finished turn has a finish reason"
        self.events[-1][3] = finish_reason
        self.finish_reason = finish_reason
        return finish_reason

    # ------------------------------------------------------------------ environment

    def add_env_tokens(self, token_ids: list[int], version: int) -> None:
        """Tokens the model did not sample (user, tool, environment): trained on never."""
        start = len(self.output_ids)
        self.output_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)
        self.events.append([ENV, start, len(self.output_ids), ""])

    def add_tool_call(self, name: str, arguments: str, result: str) -> None:
        end = len(self.output_ids)
        self.events.append([TOOL, end, end, {"name": name, "arguments": arguments, "result": result}])
        self.num_tool_calls += 1

    # ------------------------------------------------------------------ views

    def span(self, event: list) -> list[int]:
        return self.output_ids[event[1] : event[2]]

    @property
    def model_token_count(self) -> int:
        return sum(self.loss_mask)

    def oldest_model_version(self) -> int | None:
        """The version that decides the episode's freshness; None before any model token."""
        return min((v for v, m in zip(self.versions, self.loss_mask) if m), default=None)
