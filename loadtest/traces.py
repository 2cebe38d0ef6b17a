"""Seeded agent and chatbot traces with realistic sharing (`cache.md` §5.1).

A trace is a list of sessions, each with an arrival time and a list of turns. Content is
described, not stored: a `Segment` is a seed and a token count, rendered as words for a live
server (`Segment.words`, one word ≈ one token) or as token ids for the block-level simulator
(`Segment.token_ids`). The same (config, seed) gives the same trace in every process.

    agent   sessions arrive as a Poisson process; each picks an agent type (Zipf over
            `num_types`), whose system prompt (tools included) every session of the type
            shares; then turns (geometric count): the model's output (reasoning + call) is
            appended to the history, then a tool result (lognormal, heavy tail, capped) as the
            next user message, and the whole history is re-sent after a think time (the tool's
            latency, lognormal). Rare events: compaction past `compact_at_tokens` (the history
            after the system prompt is replaced by a summary), a client edit of the task
            message (a timestamp injected: the prefix breaks after the system prompt).
    chat    many users; a few long shared system prompts (Zipf over variants, each reasoning
            effort its own copy: the effort line comes first in the system block), short
            conversations in thinking mode without tools (the history keeps only the visible
            answer, never the reasoning), and revisits: a user returns to an old conversation
            after a heavy-tailed delay reaching past 7 days.

Every session's content depends only on (seed, session index) and the shared prompts only on
(seed, type), so two traces of different lengths agree on their common sessions.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

import numpy as np

from loadtest.workloads import WORDS

AGENT = "agent"
CHAT = "chat"
_VOCAB = 120_000  # simulated token ids lie in [0, _VOCAB)


@dataclass(frozen=True)
class Segment:
    """Content of `num_tokens` tokens, fixed by `seed`."""

    seed: str
    num_tokens: int

    def words(self) -> str:
        """The text a live replay sends: `num_tokens` words drawn by the seed."""
        rng = random.Random(self.seed)
        return " ".join(rng.choice(WORDS) for _ in range(self.num_tokens))

    def token_ids(self) -> np.ndarray:
        """The token ids the simulator hashes: `num_tokens` uint32 drawn by the seed."""
        digest = hashlib.sha256(self.seed.encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return rng.integers(0, _VOCAB, self.num_tokens, dtype=np.uint32)


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    think_s: seconds after the previous reply before this request (0 for the first turn).
    add: segments appended to the history before the request, as user messages (the task or
        question; a tool result).
    output_tokens: the model's output length (the simulator's; a live replay's `max_tokens`).
    answer_tokens: how much of the output the next turn's history keeps (agents: all of it,
        reasoning stays in history with tools; chat: the visible answer only).
    edit: None, "compact" (the history after the system prompt becomes `add[0]`, a summary)
        or "edit" (the first user message is replaced by `add[0]`, the edited task).
    revisit: this turn resumes a conversation after a long pause.
    """

    think_s: float
    add: tuple[Segment, ...]
    output_tokens: int
    answer_tokens: int
    edit: str | None = None
    revisit: bool = False


@dataclass(frozen=True)
class TraceSession:
    """index: position in the trace; start_s: arrival (seconds from the trace start).
    system: the shared system prompt (tools and effort line included); tools: declares tools
    (agent sessions); effort: the reasoning effort (None: thinking off)."""

    index: int
    kind: str
    start_s: float
    system: Segment
    tools: bool
    effort: str | None
    turns: tuple[Turn, ...]

    @property
    def traffic_class(self) -> str:
        return AGENT if self.tools else CHAT


@dataclass(frozen=True)
class AgentTraceConfig:
    """Agent traffic (defaults: `cache.md` §5.1). Lengths in tokens, times in seconds.

    Lognormal lengths are given by their median and sigma; `*_max` caps the tail."""

    seed: int = 0
    num_sessions: int = 100
    session_rate: float = 0.01  # sessions per second (Poisson)
    num_types: int = 8
    type_zipf: float = 1.1
    system_tokens_min: int = 4096
    system_tokens_max: int = 16384
    turns_mean: float = 30.0
    task_tokens: int = 200
    output_median: int = 500
    output_sigma: float = 0.7
    output_min: int = 200
    output_max: int = 2000
    tool_result_median: int = 800
    tool_result_sigma: float = 1.0
    tool_result_max: int = 32768
    think_median_s: float = 3.0
    think_sigma: float = 1.2
    compact_at_tokens: int = 120_000
    summary_tokens: int = 4096
    edit_probability: float = 0.01  # per turn
    efforts: tuple[tuple[str, float], ...] = (("high", 0.7), ("max", 0.3))

    def __post_init__(self) -> None:
        _check_common(self.num_sessions, self.session_rate, self.turns_mean)
        if not 0 < self.system_tokens_min <= self.system_tokens_max:
            raise ValueError("need 0 < system_tokens_min <= system_tokens_max")
        if not 0 < self.output_min <= self.output_median <= self.output_max:
            raise ValueError("need 0 < output_min <= output_median <= output_max")
        if not 0 <= self.edit_probability <= 1:
            raise ValueError("edit_probability must lie in [0, 1]")


@dataclass(frozen=True)
class ChatTraceConfig:
    """Chatbot traffic (defaults: `cache.md` §5.1). Lengths in tokens, times in seconds.

    revisit_probability: after a conversation's last turn, the chance that the user comes back
    (again after each revisit); the pause is lognormal (`revisit_median_s`, `revisit_sigma`),
    capped at `revisit_max_s`. answer_share: the visible part of an output (the rest is
    reasoning, which history drops)."""

    seed: int = 0
    num_sessions: int = 1000
    session_rate: float = 0.1
    num_variants: int = 6
    variant_zipf: float = 1.2
    system_tokens_min: int = 2048
    system_tokens_max: int = 8192
    turns_mean: float = 3.0
    question_median: int = 60
    question_sigma: float = 1.0
    question_max: int = 4096
    output_median: int = 400
    output_sigma: float = 0.8
    output_min: int = 16
    output_max: int = 4096
    answer_share: float = 0.4
    think_median_s: float = 30.0
    think_sigma: float = 1.0
    revisit_probability: float = 0.3
    revisit_median_s: float = 86400.0
    revisit_sigma: float = 1.5
    revisit_max_s: float = 30 * 86400.0
    revisit_turns_mean: float = 1.5
    efforts: tuple[tuple[str | None, float], ...] = (
        (None, 0.3),
        ("low", 0.2),
        ("high", 0.4),
        ("max", 0.1),
    )

    def __post_init__(self) -> None:
        _check_common(self.num_sessions, self.session_rate, self.turns_mean)
        if not 0 < self.system_tokens_min <= self.system_tokens_max:
            raise ValueError("need 0 < system_tokens_min <= system_tokens_max")
        if not 0 <= self.revisit_probability < 1 or not 0 < self.answer_share <= 1:
            raise ValueError("revisit_probability in [0, 1) and answer_share in (0, 1]")


def _check_common(num_sessions: int, rate: float, turns_mean: float) -> None:
    if num_sessions < 1 or not rate > 0 or not turns_mean >= 1:
        raise ValueError("num_sessions >= 1, session_rate > 0 and turns_mean >= 1")


# ---------------------------------------------------------------------------- sampling


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def _geometric(rng: random.Random, mean: float) -> int:
    """Turns ≥ 1 with the given mean (each further turn with probability 1 − 1/mean)."""
    count = 1
    while rng.random() > 1.0 / mean:
        count += 1
    return count


def _zipf(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def _pick(rng: random.Random, choices: tuple[tuple, ...]):
    return rng.choices([c[0] for c in choices], [c[1] for c in choices])[0]


def _arrivals(seed: int, kind: str, num: int, rate: float) -> list[float]:
    rng = random.Random(f"{seed}:{kind}:arrivals")
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# ---------------------------------------------------------------------------- generators


def agent_trace(config: AgentTraceConfig) -> list[TraceSession]:
    """The agent sessions of `config`, in arrival order."""
    type_rng = random.Random(f"{config.seed}:agent-types")
    systems = [
        Segment(
            f"{config.seed}:agent-system:{k}",
            type_rng.randint(config.system_tokens_min, config.system_tokens_max),
        )
        for k in range(config.num_types)
    ]
    sessions = []
    starts = _arrivals(config.seed, AGENT, config.num_sessions, config.session_rate)
    for index, start in enumerate(starts):
        rng = random.Random(f"{config.seed}:agent:{index}")
        kind = _zipf(rng, config.num_types, config.type_zipf)
        effort = _pick(rng, config.efforts)
        base = systems[kind]
        system = Segment(f"{base.seed}:{effort}", base.num_tokens)
        turns = []
        context = system.num_tokens
        task = Segment(f"{config.seed}:agent:{index}:task", config.task_tokens)
        add: tuple[Segment, ...] = (task,)
        edit = None
        for t in range(_geometric(rng, config.turns_mean)):
            output = _lognormal(
                rng, config.output_median, config.output_sigma, config.output_min,
                config.output_max,
            )  # fmt: skip
            think = (
                0.0
                if t == 0
                else min(
                    3600.0, rng.lognormvariate(math.log(config.think_median_s), config.think_sigma)
                )
            )
            context += sum(s.num_tokens for s in add)
            turns.append(Turn(think, add, output, output, edit))
            context += output
            result = Segment(
                f"{config.seed}:agent:{index}:result:{t}",
                _lognormal(
                    rng,
                    config.tool_result_median,
                    config.tool_result_sigma,
                    1,
                    config.tool_result_max,
                ),  # fmt: skip
            )
            edit = None
            add = (result,)
            if context + result.num_tokens > config.compact_at_tokens:
                add = (Segment(f"{config.seed}:agent:{index}:summary:{t}", config.summary_tokens),)
                edit, context = "compact", system.num_tokens
            elif t > 0 and rng.random() < config.edit_probability:
                add = (Segment(f"{config.seed}:agent:{index}:task-edit:{t}", config.task_tokens),
                       result)  # fmt: skip
                edit = "edit"
        sessions.append(TraceSession(index, AGENT, start, system, True, effort, tuple(turns)))
    return sessions


def chat_trace(config: ChatTraceConfig) -> list[TraceSession]:
    """The chatbot sessions of `config`, in arrival order (a revisit is a later turn of its
    session, after a long `think_s`)."""
    variant_rng = random.Random(f"{config.seed}:chat-variants")
    variants = [
        Segment(
            f"{config.seed}:chat-system:{k}",
            variant_rng.randint(config.system_tokens_min, config.system_tokens_max),
        )
        for k in range(config.num_variants)
    ]
    sessions = []
    starts = _arrivals(config.seed, CHAT, config.num_sessions, config.session_rate)
    for index, start in enumerate(starts):
        rng = random.Random(f"{config.seed}:chat:{index}")
        base = variants[_zipf(rng, config.num_variants, config.variant_zipf)]
        effort = _pick(rng, config.efforts)
        system = Segment(f"{base.seed}:{effort}", base.num_tokens)
        turns = []
        num_turns, revisit = _geometric(rng, config.turns_mean), False
        while True:
            for t in range(num_turns):
                if revisit and t == 0:
                    think = min(config.revisit_max_s,
                                rng.lognormvariate(math.log(config.revisit_median_s),
                                                   config.revisit_sigma))  # fmt: skip
                elif not turns:
                    think = 0.0
                else:
                    think = rng.lognormvariate(math.log(config.think_median_s), config.think_sigma)
                question = Segment(
                    f"{config.seed}:chat:{index}:q:{len(turns)}",
                    _lognormal(
                        rng, config.question_median, config.question_sigma, 1, config.question_max
                    ),  # fmt: skip
                )
                output = _lognormal(
                    rng, config.output_median, config.output_sigma, config.output_min,
                    config.output_max,
                )  # fmt: skip
                answer = output if effort is None else max(1, round(output * config.answer_share))
                turns.append(Turn(think, (question,), output, answer, None, revisit and t == 0))
            if rng.random() >= config.revisit_probability:
                break
            num_turns, revisit = _geometric(rng, config.revisit_turns_mean), True
        sessions.append(TraceSession(index, CHAT, start, system, False, effort, tuple(turns)))
    return sessions


@dataclass
class History:
    """The token layout of a session's history, turn by turn, as segments: what the simulator
    hashes. `prompt(turn)` is the prompt of that turn; `output(turn)` the segment the model
    wrote (the part kept in history: `answer_tokens`)."""

    session: TraceSession
    segments: list[Segment] = field(default_factory=list)

    def advance(self, turn_index: int) -> list[Segment]:
        """Apply turn `turn_index`'s edits and additions; returns the prompt's segments."""
        turn = self.session.turns[turn_index]
        if not self.segments:
            self.segments = [self.session.system]
        if turn.edit == "compact":
            self.segments = [self.session.system, *turn.add]
        elif turn.edit == "edit":
            self.segments = [self.session.system, turn.add[0], *self.segments[2:], *turn.add[1:]]
        else:
            self.segments.extend(turn.add)
        return list(self.segments)

    def answer(self, turn_index: int) -> Segment:
        """Record the model's output of `turn_index` in the history (its kept part)."""
        turn = self.session.turns[turn_index]
        seed = f"{self.session.system.seed}:{self.session.index}:{turn_index}:output"
        kept = Segment(seed, turn.answer_tokens)
        self.segments.append(kept)
        return kept
