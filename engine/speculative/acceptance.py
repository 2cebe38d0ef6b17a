"""Lossless acceptance of drafted tokens (`dspark.md` §2): pure functions, no engine state.

One step's verify rows arrive flat and request-major. Request r owns `1 + L_r` rows; its row j
(0 ≤ j ≤ L_r) holds the target distribution of position `p + j + 1`, which is where draft
`d_{j+1}` sits (j < L_r) or where the bonus token goes (j = L_r):

    rows of r     [ row 0      row 1      ...  row L_r   ]
    tests         [ d_1        d_2        ...  (bonus)   ]   proposals, −1 on the bonus row
    emits if ok   [ d_1        d_2        ...  target    ]

Rules:

* **match** (greedy requests, and every request in the `coupled` mode): accept `d_{j+1}` iff it
  equals the row's `target` — the token the ordinary sampler draws from that row (argmax, or the
  Gumbel-max draw with the (seed, position) noise). The token emitted at the first mismatch (or
  after `d_L`) is that row's target, so every emitted token is exactly the non-speculative
  draw at its position.
* **rejection** (sampled requests in the default mode, Leviathan et al.; `dspark.md` §2.2):
  accept `d` iff `u · q(d) < p(d)` with `p` the processed target distribution of the row,
  `q = softmax(draft logits)` the distribution the draft was sampled from; at the first
  rejection emit a draw from `normalize(max(p − q, 0))`, after `d_L` the row's target (a draw
  from p). The output distribution equals non-speculative sampling for any q.
* **block** (sampled requests with `--speculative-acceptance block`, Sun et al. 2024,
  arXiv 2403.10444; `dspark.md` §2.4): the request's L drafts are decided jointly. With prefix
  weights `w_0 = 1, w_i = min(1, w_{i−1} · p_i(d_i) / q_i(d_i))`, stopping probabilities
  `h_L = w_L` and `h_i = ρ_i / (ρ_i + 1 − w_i)`, `ρ_i = Σ_x max(w_i · p_{i+1}(x) − q_{i+1}(x),
  0)` (i < L), and one independent coin per draft, `η` = the largest i with `u_i ≤ h_i` (0 if
  none): emit `d_1..d_η`, then the row's target if η = L, else a draw from
  `normalize(max(w_η · p_{η+1} − q_{η+1}, 0))`. Lossless (completed by target sampling, the
  first L + 1 tokens follow the target), and never fewer accepted drafts in expectation than
  `rejection` for the same drafts. It runs over the verified prefix only (the compact layout,
  `dspark.md` §2.3): rows 0..L of request r are all its rows.

Randomness is keyed by (request seed, absolute position, purpose): the coin and the residual
noise never depend on the batch row or the step's composition. Residual noise is keyed by the
emitted token's position; token-wise coins by the tested draft's position; block coins by the
request's anchor position and the draft index (every coin of a block is read, see
`_block_tests`), and block-verified requests draft with `block_draft_seeds`, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models import ints_to_device
from engine.sampler import NoisePurpose, counter_hash, gumbel_from_hash, noise_keys

SAMPLED_RULES = ("rejection", "block")  # how sampled rows test their drafts against q


@dataclass(frozen=True)
class VerifyRows:
    """One step's verify rows (see the module docstring), all tensors on one device.

    processed: [R, V] fp32 processed target logits (bias, penalties, temperature, filters and
        grammar mask applied; −inf where the target gives probability 0).
    targets: [R] int64, the ordinary sampler's draw from each row.
    proposals: [R] int64, the draft each row tests (−1 on bonus rows).
    draft_logits: [R, V] fp32 logits the row's proposal was sampled from (softmax = q), read
        only on `rejection` rows; None when no row uses rejection.
    rejection: [R] bool, rows tested against q by `sampled_rule` (the others by exact match);
        under `block` a request's proposal rows are all in it or none are.
    seeds, positions: [R] int64, the request's seed and the emitted token's absolute position.
    lengths: host ints, L_r per request (request r owns `1 + lengths[r]` consecutive rows).
    sampled_rule: one of `SAMPLED_RULES`: `rejection` token by token, `block` per request.
    """

    processed: torch.Tensor
    targets: torch.Tensor
    proposals: torch.Tensor
    draft_logits: torch.Tensor | None
    rejection: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    lengths: list[int]
    sampled_rule: str = "rejection"

    def __post_init__(self) -> None:
        if self.sampled_rule not in SAMPLED_RULES:
            raise ValueError(
                f"sampled_rule must be one of {SAMPLED_RULES}, not {self.sampled_rule!r}"
            )


@dataclass(frozen=True)
class Verdict:
    """Per request: `accepted` drafts (a_r ≤ L_r) and the `emitted` tokens (d_1..d_a, then the
    correction or bonus token): a_r + 1 tokens."""

    accepted: list[int]
    emitted: list[list[int]]


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """U(0, 1) (fp64, never 0 or 1) from 32-bit hashes."""
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def block_draft_seeds(seeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The seeds block-verified requests draft with at anchor position p (int64 [B]): a hash of
    (seed, p), so no two steps of a request share draft noise.

    NOTE: the block decision depends on every verified draft, so draft noise keyed by position
    alone would be reused, conditioned on the outcome, by the next step's drafts at the same
    positions (token-wise rejection never reads a draft after the first rejected one)."""
    keys = noise_keys(seeds, anchors, NoisePurpose.DRAFT)
    high = torch.where(keys[:, 1] >= 1 << 31, keys[:, 1] - (1 << 32), keys[:, 1])
    return keys[:, 0] + high * (1 << 32)


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
    is the first one not accepted). Bonus rows never pass; match rows' residual is their
    target."""
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
    # NOTE: a proposal with q(d) = 0 (impossible for a draw from q, possible through numerics)
    # gets the log ratio −inf: rejected, as is any non-finite test.
    lp, lq = logp.gather(1, d).squeeze(1).double(), logq.gather(1, d).squeeze(1).double()
    log_ratio = torch.where(torch.isfinite(lq) & ~torch.isnan(lp), lp - lq, -torch.inf)
    ok, log_excess = _SAMPLED_TESTS[rows.sampled_rule](rows, sel, log_ratio, logp, logq)
    passed[sel] = ok
    residual[sel] = _residual_draw(log_excess, rows, sel)
    return passed, residual


def _token_tests(
    rows: VerifyRows,
    sel: torch.Tensor,
    log_ratio: torch.Tensor,
    logp: torch.Tensor,
    logq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling, row by row: (accepted [S], log max(p − q, 0) [S, V])."""
    coin_keys = noise_keys(rows.seeds[sel], rows.positions[sel], NoisePurpose.COIN)
    first = torch.zeros(1, dtype=torch.long, device=sel.device)
    u = uniform_from_hash(counter_hash(coin_keys, first)).squeeze(1)
    return u.log() < log_ratio, _log_excess(logp, logq)


def _block_tests(
    rows: VerifyRows,
    sel: torch.Tensor,
    log_ratio: torch.Tensor,
    logp: torch.Tensor,
    logq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification per request: (row j accepted iff j < η [S], log max(w_j · p − q, 0)
    [S, V]). The scalar recursions run on a [requests, max L] table, column c for draft c + 1:

        x_c = log p(d_{c+1}) / q(d_{c+1})          from row c
        log w_{c+1} = S_c − max(0, S_0..S_c),  S = cumsum(x)    (= min(0, log w_c + x_c))
        h_{c+1} = ρ_{c+1} / (ρ_{c+1} + 1 − w_{c+1})  (c + 1 < L),  h_L = w_L
        ρ_j = Σ_x max(w_j · p_{j+1}(x) − q_{j+1}(x), 0)          from row j's excess
        η = max{i : u_i ≤ h_i} (0 if none)

    NOTE: the coins are keyed by the request's anchor position p and the draft index i, not by
    the draft's position: every coin of the block is read (η is the *largest* i that passes),
    so a coin keyed by position would be read again, conditioned, by the next step's drafts at
    the same positions. u_i ≤ h_i is tested as u_i · (ρ_i + 1 − w_i) ≤ ρ_i (no 0/0).
    """
    dev = sel.device
    lengths = rows.lengths
    num_requests, width = len(lengths), max(lengths)
    counts = ints_to_device([n + 1 for n in lengths], dev)
    starts = counts.cumsum(0) - counts
    request = torch.repeat_interleave(
        torch.arange(num_requests, device=dev), counts, output_size=rows.targets.numel()
    )
    column = torch.arange(rows.targets.numel(), device=dev) - starts[request]
    b, c = request[sel], column[sel]
    x = torch.zeros(num_requests, width, dtype=torch.float64, device=dev)
    x.index_put_((b, c), log_ratio)
    s = x.cumsum(1)
    log_w = s - s.clamp(min=0).cummax(1).values  # log w_{c+1}
    log_w_before = torch.cat([torch.zeros_like(log_w[:, :1]), log_w[:, :-1]], 1)  # log w_c
    log_excess = _log_excess(logp + log_w_before[b, c].float()[:, None], logq)
    rho = torch.zeros(num_requests, width + 1, dtype=torch.float64, device=dev)
    rho.index_put_((b, c), log_excess.logsumexp(-1).double().exp())
    rho_next = rho[:, 1:]  # column c: ρ_{c+1}
    num_drafts = (counts - 1)[:, None]
    cols = torch.arange(width, device=dev)
    keys = noise_keys(rows.seeds[starts], rows.positions[starts] - 1, NoisePurpose.COIN)
    u = uniform_from_hash(counter_hash(keys, cols + 1))  # u_{c+1}
    stops_inner = u * (rho_next - log_w.expm1()) <= rho_next
    stops = torch.where(cols == num_drafts - 1, u.log() <= log_w, stops_inner)
    stops &= cols < num_drafts
    eta = (stops * (cols + 1)).amax(1)
    return c < eta[b], log_excess


_SAMPLED_TESTS = {"rejection": _token_tests, "block": _block_tests}


def _log_excess(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """log max(exp(log_a) − exp(log_b), 0), −inf where it is 0."""
    diff = log_a + torch.log1p(-torch.exp(log_b - log_a))
    return torch.where(log_a > log_b, diff, -torch.inf)


def _residual_draw(log_excess: torch.Tensor, rows: VerifyRows, sel: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draws from normalize(exp(log_excess)), noise keyed by (seed, the emitted
    token's position); the row's target where the excess has no mass (the rule then stops
    there with probability 0, and any token is fine)."""
    vocab = torch.arange(log_excess.shape[1], device=log_excess.device)
    keys = noise_keys(rows.seeds[sel], rows.positions[sel], NoisePurpose.RESIDUAL)
    drawn = (log_excess + gumbel_from_hash(counter_hash(keys, vocab))).argmax(-1)
    return torch.where(torch.isfinite(log_excess).any(-1), drawn, rows.targets[sel])
