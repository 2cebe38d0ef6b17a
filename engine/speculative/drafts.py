"""Where drafts come from: the `DraftSource` contract and the DSpark drafter behind it.

A draft source proposes, for each decoding request, `num_drafts` tokens after its anchor (the
last sampled token, at position p), the logits each was drawn from (for rejection sampling) and
a confidence per draft (for the planner). Sampled drafts use noise keyed by (seed, absolute
position p + s + 1, purpose), never by batch row: `DRAFT` in the rejection mode, the target
sampler's own `SAMPLE` stream in the coupled mode (`dspark.md` §1.5, §2.5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from engine.sampler import MIN_TEMPERATURE, NoisePurpose, counter_hash, gumbel_from_hash, noise_keys

if TYPE_CHECKING:
    from engine.models import DeepseekV41ForCausalLM
    from engine.models.deepseek_v41.state import ModelState


@dataclass(frozen=True)
class DraftRequests:
    """The decoding requests of one step that draft (device tensors, one row each).

    anchors, positions, slots: int64 [B]: last sampled token, its position p, state slot.
    seeds: int64 [B]; temperatures: fp32 [B] (0 = greedy draft); is_sampled: host bools.
    purpose: the noise stream of sampled drafts.
    """

    anchors: Tensor
    positions: Tensor
    slots: Tensor
    seeds: Tensor
    temperatures: Tensor
    is_sampled: tuple[bool, ...]
    purpose: NoisePurpose


@dataclass(frozen=True)
class Proposal:
    """drafts: int64 [B, K]; logits: fp32 [B, K, V], the (temperature-scaled) logits draft k was
    drawn from, or None when every row drafted greedily; confidence: [B, K] in (0, 1), draft k's
    predicted acceptance given drafts < k accepted."""

    drafts: Tensor
    logits: Tensor | None
    confidence: Tensor


class DraftSource(Protocol):
    num_drafts: int

    def propose(self, requests: DraftRequests) -> Proposal: ...


DraftFactory = Callable[["DeepseekV41ForCausalLM", "ModelState"], DraftSource]
"""Builds a runner's draft source over its model and state (`DSparkDrafts` is one); picklable
ones cross a process spawn (tests inject drafts into expert-parallel ranks this way)."""


class DSparkDrafts:
    """Drafts from the checkpoint's DSpark drafter (`model.md` §6.1) over the runner's state,
    whose draft rings the speculative step fills with committed context rows."""

    def __init__(self, model: DeepseekV41ForCausalLM, state: ModelState) -> None:
        if model.mtp is None:
            raise ValueError("speculative decoding with dspark needs the DSpark drafter weights")
        self.model = model
        self.state = state
        self.num_drafts = model.config.dspark_block_size

    def propose(self, requests: DraftRequests) -> Proposal:
        kept: list[Tensor] = []
        sampler = _DraftSampler(requests, kept)
        out = self.model.draft(
            requests.anchors,
            requests.positions,
            requests.slots,
            self.state,
            choose=sampler if any(requests.is_sampled) else None,
        )
        logits = torch.stack(kept, 1) if kept else None
        return Proposal(out.drafts, logits, out.confidence)


class _DraftSampler:
    """`choose(s, z)` for the drafter's Markov loop: argmax for greedy rows, Gumbel-max at the
    row's temperature with position-keyed noise for sampled rows; keeps each step's scaled
    logits (the q of rejection sampling)."""

    def __init__(self, requests: DraftRequests, kept: list[Tensor]) -> None:
        self.requests = requests
        self.kept = kept
        sampled = torch.tensor(requests.is_sampled, device=requests.anchors.device)
        self.sampled = sampled
        t = requests.temperatures.clamp(min=MIN_TEMPERATURE)
        self.divisor = torch.where(sampled, t, torch.ones_like(t))[:, None]

    def __call__(self, step: int, z: Tensor) -> Tensor:
        r = self.requests
        x = z.float() / self.divisor
        self.kept.append(x)
        keys = noise_keys(r.seeds, r.positions + step + 1, r.purpose)
        vocab = torch.arange(x.shape[1], device=x.device)
        drawn = (x + gumbel_from_hash(counter_hash(keys, vocab))).argmax(-1)
        return torch.where(self.sampled, drawn, z.argmax(-1))
