"""What the API process and the engine ranks send each other (plain picklable dataclasses, no
tensors), over one `multiprocessing.connection` per rank.

    API → rank:  RankSetup (once, the answer to RankHello), AddRequests, AbortRequests,
                 SetGrammarVocabulary, Stop
    rank → API:  RankHello (on connecting), RankReady (once, after loading), StepResult
                 (after every step that ran or received something), RankFailed (then it exits)

A connection that ends (EOF) without `RankFailed` means the rank died.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.async_engine import EngineConfig
from engine.client import EngineInfo, RankSnapshot
from engine.limits import RequestLimits
from engine.outputs import Delta
from engine.sampling_params import SamplingParams
from engine.structured.grammar import GrammarSpec, MarkerGuard


@dataclass(frozen=True)
class WireConstraint:
    """A compiled grammar as bytes: `xgrammar.CompiledGrammar.serialize_json`, rebuilt on the
    rank against the vocabulary of `SetGrammarVocabulary` (xgrammar objects do not pickle)."""

    spec: GrammarSpec
    grammar_json: str
    guard: MarkerGuard | None


@dataclass(frozen=True)
class WireRequest:
    """One engine request (one choice of a user request), as `AsyncEngine` builds it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    index: int
    constraint: WireConstraint | None
    cache_salt: str | None
    traffic_class: str | None = None


@dataclass(frozen=True)
class RankSetup:
    """What the rank serves: node 0's engine config, `model` as the user gave it (each rank
    resolves it on its own node). Every rank, on every node, gets the same one."""

    engine: EngineConfig


@dataclass(frozen=True)
class AddRequests:
    requests: tuple[WireRequest, ...]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class SetGrammarVocabulary:
    """The grammar compiler's `TokenizerInfo.serialize_json` (sent once, before the first
    constrained request)."""

    tokenizer_info_json: str


@dataclass(frozen=True)
class Stop:
    """Leave the step loop (together with every rank) and exit."""


@dataclass(frozen=True)
class RankHello:
    rank: int
    pid: int


@dataclass(frozen=True)
class RankReady:
    """A rank has loaded its shard: what it serves, the limits its scheduler enforces on each
    request (the front end checks requests against them) and its first snapshot."""

    rank: int
    info: EngineInfo
    limits: RequestLimits
    snapshot: RankSnapshot


@dataclass(frozen=True)
class StepResult:
    rank: int
    deltas: tuple[Delta, ...]
    snapshot: RankSnapshot


@dataclass(frozen=True)
class RankFailed:
    rank: int
    error: str
