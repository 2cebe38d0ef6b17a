"""Lossless acceptance of drafted tokens (`dspark.md` §2): pure functions, no engine state.

One step's verify rows arrive flat and request-major. Request r owns `1 + L_r` rows; its row j
(0 ≤ j ≤ L_r) holds the target distribution of position `p + j + 1`, which is where draft
`d_{j+1}` sits (j < L_r) or where the bonus token goes (j = L_r):

    rows of r     [ row 0      row 1      ...  row L_r   ]
    tests         [ d_1        d_2        ...  (bonus)   ]   proposals, −1 on the bonus row
    emits if ok   [ d_1        d_2        ...  target    ]

Two rules, per row:

* **match** (greedy requests, and every request in the `coupled` mode): accept `d_{j+1}` iff it
  equals the row's `target` — the token the ordinary sampler draws from that row (argmax, or the
  Gumbel-max draw with the (seed, position) noise). The token emitted at the first mismatch (or
  after `d_L`) is that row's target, so every emitted token is exactly the non-speculative
  draw at its position.
* **rejection** (sampled requests in the default mode, Leviathan et al.): accept `d` iff
  `u · q(d) < p(d)` with `p` the processed target distribution of the row, `q = softmax(draft
  logits)` the distribution the draft was sampled from; at the first rejection emit a draw
  from `normalize(max(p − q, 0))`, after `d_L` the row's target (a draw from p). The output
  distribution equals non-speculative sampling for any q.

Randomness is keyed by (request seed, absolute position of the emitted token, purpose): the coin
and the residual noise never depend on the batch row, the step or the verify length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import NoisePurpose, counter_hash, gumbel_from_hash, noise_keys


@dataclass(frozen=True)
class VerifyRows:
    """One step's verify rows (see the module docstring), all tensors on one device.

    processed: [R, V] fp32 processed target logits (bias, penalties, temperature, filters and
        grammar mask applied; −inf where the target gives probability 0).
    targets: [R] int64, the ordinary sampler's draw from each row.
    proposals: [R] int64, the draft each row tests (−1 on bonus rows).
    draft_logits: [R, V] fp32 logits the row's proposal was sampled from (softmax = q), read
        only on `rejection` rows; None when no row uses rejection.
    rejection: [R] bool, rows tested by rejection sampling (the others by exact match).
    seeds, positions: [R] int64, the request's seed and the emitted token's absolute position.
    lengths: host ints, L_r per request (request r owns `1 + lengths[r]` consecutive rows).
    """

    processed: torch.Tensor
    targets: torch.Tensor
    proposals: torch.Tensor
    draft_logits: torch.Tensor | None
    rejection: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    lengths: list[int]


@dataclass(frozen=True)
class Verdict:
    """Per request: `accepted` drafts (a_r ≤ L_r) and the `emitted` tokens (d_1..d_a, then the
    correction or bonus token): a_r + 1 tokens."""

    accepted: list[int]
    emitted: list[list[int]]


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """U(0, 1) (fp64, never 0 or 1) from 32-bit hashes."""
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def verify(rows: VerifyRows) -> Verdict:
    """Accept the longest prefix of each request's drafts by its rule; pick the next token."""
    passed, residual = _row_tests(rows)
    passed_host = passed.tolist()
    residual_host = residual.tolist()
    targets_host = rows.targets.tolist()
    proposals_host = rows.proposals.tolist()
    accepted, emitted = [], []
    start = 0
    for length in rows.lengths:
        a = 0
        while a < length and passed_host[start + a]:
            a += 1
        last = start + a
        tokens = proposals_host[start:last]
        tokens.append(residual_host[last] if a < length else targets_host[last])
        accepted.append(a)
        emitted.append(tokens)
        start += length + 1
    if start != rows.targets.numel():
        raise ValueError(f"lengths cover {start} rows, the step has {rows.targets.numel()}")
    return Verdict(accepted, emitted)


def _row_tests(rows: VerifyRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(passed [R] bool: the row's proposal is accepted; residual [R]: the token to emit if it
    is rejected). Bonus rows never pass; match rows' residual is their target."""
    has_proposal = rows.proposals >= 0
    passed = has_proposal & (rows.proposals == rows.targets)
    residual = rows.targets.clone()
    sel = (rows.rejection & has_proposal).nonzero().squeeze(1)
    if sel.numel() == 0:
        return passed, residual
    if rows.draft_logits is None:
        raise ValueError("rejection rows need the draft logits")
    logp = rows.processed.index_select(0, sel).log_softmax(-1)
    logq = rows.draft_logits.index_select(0, sel).float().log_softmax(-1)
    d = rows.proposals[sel][:, None]
    lp, lq = logp.gather(1, d).squeeze(1), logq.gather(1, d).squeeze(1)
    seeds, positions = rows.seeds[sel], rows.positions[sel]
    coin_keys = noise_keys(seeds, positions, NoisePurpose.COIN)
    first = torch.zeros(1, dtype=torch.long, device=d.device)
    u = uniform_from_hash(counter_hash(coin_keys, first))
    # NOTE: a proposal with q(d) = 0 (impossible for a draw from q, possible through numerics)
    # is rejected, as is any non-finite test.
    ok = (u.squeeze(1).log() + lq.double() < lp.double()) & torch.isfinite(lq)
    passed[sel] = ok
    excess = (logp.exp() - logq.exp()).clamp_(min=0)
    vocab = torch.arange(excess.shape[1], device=excess.device)
    residual_keys = noise_keys(seeds, positions, NoisePurpose.RESIDUAL)
    noise = gumbel_from_hash(counter_hash(residual_keys, vocab))
    drawn = (excess.log() + noise).argmax(-1)
    # p == q leaves no residual mass; then rejection has probability 0 and any token is fine.
    residual[sel] = torch.where(excess.sum(-1) > 0, drawn, rows.targets[sel])
    return passed, residual
