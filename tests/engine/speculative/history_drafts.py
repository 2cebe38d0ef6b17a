"""`HistoryDrafts`: a test draft source that proposes known continuations (shared by the
in-process speculation tests and the expert-parallel ones, whose rank processes build it
through `history_drafts`).

Each request's continuation in a run without speculation is found by the request's last
committed tokens (the runner's token history) and its anchor, with one wrong draft at a
position-chosen index (none at some positions), so commits of every width occur; a request whose
history matches no continuation gets drafts that are rejected. Which drafts are accepted is still
decided by the target's verify logits.
"""

from __future__ import annotations

import random

import torch

from engine.models.deepseek_v41.state import TOKEN_RING
from engine.speculative.drafts import DraftRequests, Proposal

HISTORY = 3


class HistoryDrafts:
    """Drafts from known continuations, found by (last HISTORY tokens, anchor, position)."""

    num_drafts = 5

    def __init__(self, vocab_size: int, references: list[list[int]], state=None) -> None:
        """references: prompt + continuation, one per request; state: the runner's
        ModelState (its token history), set once the engine exists when not given here."""
        self.vocab_size = vocab_size
        self.references = references
        self.state = state

    def propose(self, requests: DraftRequests) -> Proposal:
        rows = []
        anchors = requests.anchors.tolist()
        for anchor, p, slot in zip(
            anchors, requests.positions.tolist(), requests.slots.tolist(), strict=True
        ):
            ring = [q % TOKEN_RING for q in range(p - HISTORY, p)]
            history = [*self.state.tokens[slot, ring].tolist(), anchor]
            ref = next((r for r in self.references if r[p - HISTORY : p + 1] == history), None)
            if ref is None:
                rows.append([(anchor + 1) % self.vocab_size] * self.num_drafts)
                continue
            drafts = [ref[q] if q < len(ref) else 0 for q in range(p + 1, p + 1 + self.num_drafts)]
            wrong = random.Random(p).randrange(self.num_drafts + 1)
            if wrong < self.num_drafts:
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab_size
            rows.append(drafts)
        drafts = torch.tensor(rows, dtype=torch.long)
        # The drafts are fixed tokens: q is one-hot at each (what rejection sampling needs).
        logits = torch.full((*drafts.shape, self.vocab_size), float("-inf"))
        logits.scatter_(2, drafts[..., None], 0.0)
        return Proposal(drafts, logits, torch.full(drafts.shape, 0.5))


def history_drafts(references: list[list[int]], model, state) -> HistoryDrafts:
    """A rank's draft factory (`functools.partial(history_drafts, references)` pickles across
    the spawn): `HistoryDrafts` over the rank's model and runner state."""
    return HistoryDrafts(model.config.vocab_size, references, state)
