"""Block verification (`acceptance.py`, `dspark.md` §2.4) against the target distribution.

A "language" over a vocabulary of 3–4 given as trees: the target row p[prefix] and the draft row
q[prefix] for every prefix of up to γ = 3 tokens after the anchor. `_block_outcomes` is the rule
written out in exact arithmetic, one draft sequence at a time; enumerating every draft sequence
gives the exact distribution of the first L + 1 tokens (the step's tokens, completed by target
sampling), which must equal the target's to 1e-12 for every cap L = 0..γ. A variant without the
w_η factor in the residual must not. `verify` itself is then checked against the exact outcome
probabilities by a chi-square over many seeded trials (and must reject the wrong variant's).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from engine.sampler import NoisePurpose, counter_hash, gumbel_from_hash, noise_keys
from engine.speculative.acceptance import VerifyRows, block_draft_seeds, verify

GAMMA = 3
Tree = dict[tuple[int, ...], list[float]]


def _tree(vocab: int, depth: int, seed: int, *, zeros: bool) -> tuple[Tree, Tree]:
    """Random target rows p and noisy draft rows q for every prefix of up to `depth` tokens;
    with `zeros`, some entries of p (a top-k cut) and of q are exactly 0."""
    g = torch.Generator().manual_seed(seed)
    p: Tree = {}
    q: Tree = {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            logp = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
            logq = logp + torch.randn(vocab, generator=g, dtype=torch.float64) * 1.2
            if zeros:
                logp[torch.randint(vocab, (1,), generator=g)] = -torch.inf
                logq[torch.randint(vocab, (1,), generator=g)] = -torch.inf
            p[prefix] = logp.softmax(0).tolist()
            q[prefix] = logq.softmax(0).tolist()
    return p, q


def _block_terms(
    p: Tree, q: Tree, drafts: tuple[int, ...], context: tuple[int, ...] = ()
) -> tuple[list[float], list[float]]:
    """(w_0..w_L, h_0..h_L) of `dspark.md` §2.4 for drafts after `context`, exactly."""
    n = len(drafts)
    w = [1.0]
    for i, d in enumerate(drafts):
        ctx = (*context, *drafts[:i])
        w.append(min(1.0, w[-1] * p[ctx][d] / q[ctx][d]) if q[ctx][d] > 0 else 0.0)
    h = [1.0]  # h_0 = 1: η = 0 when no coin passes
    for i in range(1, n + 1):
        if i == n:
            h.append(w[n])
            continue
        ctx = (*context, *drafts[:i])
        rho = sum(max(w[i] * a - b, 0.0) for a, b in zip(p[ctx], q[ctx], strict=True))
        den = rho + 1.0 - w[i]
        h.append(1.0 if den == 0 else rho / den)
    return w, h


def _block_outcomes(
    p: Tree,
    q: Tree,
    drafts: tuple[int, ...],
    *,
    weighted_residual: bool = True,
    context: tuple[int, ...] = (),
    coin_floors: dict[int, float] | None = None,
) -> dict[tuple[int, ...], float]:
    """P(emitted tokens | drafts) under block verification, exactly (float64): keys are the
    context, then the emitted tokens. `weighted_residual=False` is the wrong variant
    normalize(max(p − q, 0)); `coin_floors` {i: a} makes coin u_i uniform on (a, 1) instead of
    (0, 1) (a coin already read, and failed, by an earlier step)."""
    n = len(drafts)
    w, h = _block_terms(p, q, drafts, context)
    floors = coin_floors or {}
    out: dict[tuple[int, ...], float] = {}
    survive = 1.0  # P(no coin above i passes)
    for i in range(n, -1, -1):
        a = floors.get(i, 0.0)
        stop = 1.0 if i == 0 else max(h[i] - a, 0.0) / (1.0 - a)
        prob = stop * survive
        survive *= 1.0 - stop
        ctx = (*context, *drafts[:i])
        if i == n:
            row = p[ctx]
        else:
            scale = w[i] if weighted_residual else 1.0
            excess = [max(scale * a - b, 0.0) for a, b in zip(p[ctx], q[ctx], strict=True)]
            total = sum(excess)
            row = [e / total for e in excess] if total > 0 else p[ctx]
        for y, py in enumerate(row):
            if prob * py > 0:
                out[(*ctx, y)] = out.get((*ctx, y), 0.0) + prob * py
    return out


def _token_outcomes(p: Tree, q: Tree, drafts: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """P(emitted tokens | drafts) under token-wise rejection sampling, exactly."""
    out: dict[tuple[int, ...], float] = {}
    reach = 1.0
    for i, d in enumerate(drafts):
        ctx = drafts[:i]
        accept = min(1.0, p[ctx][d] / q[ctx][d]) if q[ctx][d] > 0 else 0.0
        excess = [max(a - b, 0.0) for a, b in zip(p[ctx], q[ctx], strict=True)]
        total = sum(excess)
        for y, e in enumerate(excess):
            if total > 0 and e > 0:
                out[(*ctx, y)] = reach * (1.0 - accept) * e / total
        reach *= accept
    for y, py in enumerate(p[drafts]):
        out[(*drafts, y)] = out.get((*drafts, y), 0.0) + reach * py
    return out


def _draft_sequences(q: Tree, vocab: int, n: int, context: tuple[int, ...] = ()):
    """Every draft sequence of length n after `context` with its probability under q."""
    for drafts in itertools.product(range(vocab), repeat=n):
        prob = 1.0
        for i, d in enumerate(drafts):
            prob *= q[(*context, *drafts[:i])][d]
        if prob > 0:
            yield drafts, prob


def _first_tokens(p: Tree, q: Tree, vocab: int, n: int, outcomes) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first n + 1 tokens: a step with n drafts, the rest of the
    n + 1 positions sampled from the target."""
    dist: dict[tuple[int, ...], float] = {}
    for drafts, q_prob in _draft_sequences(q, vocab, n):
        for emitted, prob in outcomes(p, q, drafts).items():
            rest = n + 1 - len(emitted)
            for tail in itertools.product(range(vocab), repeat=rest):
                seq, mass = emitted, q_prob * prob
                for y in tail:
                    mass *= p[seq][y]
                    seq = (*seq, y)
                dist[seq] = dist.get(seq, 0.0) + mass
    return dist


def _target(p: Tree, vocab: int, n: int) -> dict[tuple[int, ...], float]:
    dist = {}
    for seq in itertools.product(range(vocab), repeat=n + 1):
        mass = 1.0
        for i, y in enumerate(seq):
            mass *= p[seq[:i]][y]
        dist[seq] = mass
    return dist


def _max_error(got: dict, want: dict) -> float:
    return max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))


CASES = [(3, 0, False), (3, 1, True), (4, 2, False), (4, 3, True)]  # (vocab, seed, zeros)


@pytest.mark.parametrize(("vocab", "seed", "zeros"), CASES)
def test_block_verification_is_exactly_lossless_at_every_cap(vocab, seed, zeros) -> None:
    p, q = _tree(vocab, GAMMA, seed, zeros=zeros)
    for n in range(GAMMA + 1):
        want = _target(p, vocab, n)
        assert _max_error(_first_tokens(p, q, vocab, n, _block_outcomes), want) < 1e-12, n
        assert _max_error(_first_tokens(p, q, vocab, n, _token_outcomes), want) < 1e-12, n


def _unweighted(p: Tree, q: Tree, drafts: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    return _block_outcomes(p, q, drafts, weighted_residual=False)


@pytest.mark.parametrize(("vocab", "seed", "zeros"), [c for c in CASES if c[0] == 4])
def test_an_unweighted_residual_is_detected(vocab, seed, zeros) -> None:
    """Negative control: the residual normalize(max(p − q, 0)) without w_η. It differs only
    after η ≥ 1 < L and where the two residuals' supports hold two tokens or more (vocab 4)."""
    p, q = _tree(vocab, GAMMA, seed, zeros=zeros)
    for n in (2, 3):
        assert _max_error(_first_tokens(p, q, vocab, n, _unweighted), _target(p, vocab, n)) > 1e-4


def _complete(p: Tree, vocab: int, emitted: tuple[int, ...], mass: float, length: int, dist):
    """Add `mass` on `emitted` (cut at `length`), completed by target sampling, to `dist`."""
    emitted = emitted[:length]
    for tail in itertools.product(range(vocab), repeat=length - len(emitted)):
        seq, m = emitted, mass
        for y in tail:
            m *= p[seq][y]
            seq = (*seq, y)
        dist[seq] = dist.get(seq, 0.0) + m


def _two_steps(p: Tree, q: Tree, vocab: int, n: int, *, reused_coins: bool) -> dict:
    """The exact distribution of the first 2n + 2 tokens after two block steps of n drafts.
    With `reused_coins`, the second step's coins are the first step's at the same positions
    (as coins keyed by the draft's position would be): step 1 read u_k for every k ≤ n and
    η = i means u_k > h_k for k > i, so step 2's draft j (at position i + 1 + j) meets a coin
    uniform on (h_{i+1+j}, 1) while i + 1 + j ≤ n."""
    dist: dict[tuple[int, ...], float] = {}
    for drafts, q_prob in _draft_sequences(q, vocab, n):
        _, h = _block_terms(p, q, drafts)
        for first, prob in _block_outcomes(p, q, drafts).items():
            eta = len(first) - 1
            floors = {k - eta - 1: h[k] for k in range(eta + 2, n + 1)} if reused_coins else {}
            for second, q2 in _draft_sequences(q, vocab, n, first):
                outcomes = _block_outcomes(p, q, second, context=first, coin_floors=floors)
                for emitted, prob2 in outcomes.items():
                    _complete(p, vocab, emitted, q_prob * prob * q2 * prob2, 2 * n + 2, dist)
    return dist


@pytest.mark.parametrize(("vocab", "seed"), [(3, 4), (4, 5)])
def test_consecutive_block_steps_need_fresh_coins(vocab: int, seed: int) -> None:
    """Two block steps in a row follow the target exactly with fresh coins (keyed by the
    step's anchor, as `acceptance.py` keys them) and do not with coins keyed by position,
    which the second step would read again after the first one read and conditioned them."""
    n = 2
    p, q = _tree(vocab, 2 * n + 1, seed, zeros=False)
    want = _target(p, vocab, 2 * n + 1)
    assert _max_error(_two_steps(p, q, vocab, n, reused_coins=False), want) < 1e-12
    assert _max_error(_two_steps(p, q, vocab, n, reused_coins=True), want) > 1e-4


def _expected_accepted(p: Tree, q: Tree, vocab: int, n: int, outcomes) -> float:
    return sum(
        q_prob * prob * (len(emitted) - 1)
        for drafts, q_prob in _draft_sequences(q, vocab, n)
        for emitted, prob in outcomes(p, q, drafts).items()
    )


def test_block_verification_accepts_at_least_as_many_drafts_as_token_wise() -> None:
    gains = []
    for seed in range(8):
        vocab = 3 + seed % 2
        p, q = _tree(vocab, GAMMA, 100 + seed, zeros=seed % 3 == 0)
        for n in range(1, GAMMA + 1):
            block = _expected_accepted(p, q, vocab, n, _block_outcomes)
            token = _expected_accepted(p, q, vocab, n, _token_outcomes)
            assert block >= token - 1e-12, (seed, n)
            gains.append(block - token)
    assert max(gains) > 1e-3  # strictly better somewhere: the comparison is not vacuous


# ---- the implementation against the exact outcome probabilities ----------------------------

TRIALS = 60_000
ANCHOR = 40  # the anchor's absolute position


def _verify_trials(
    p: Tree, q: Tree, vocab: int, n: int, device: str = "cpu"
) -> list[tuple[tuple, tuple]]:
    """TRIALS seeded block steps with drafts drawn from q: (drafts, emitted) per trial."""
    g = torch.Generator().manual_seed(n)
    drafts = torch.zeros(TRIALS, n, dtype=torch.long)
    for i in range(n):
        rows = torch.tensor([q[tuple(d)] for d in drafts[:, :i].tolist()], dtype=torch.float64)
        drafts[:, i] = torch.multinomial(rows, 1, generator=g).squeeze(1)
    prefixes = [tuple(d[:j]) for d in drafts.tolist() for j in range(n + 1)]
    logp = torch.tensor([p[c] for c in prefixes], dtype=torch.float64).log().float()
    q_rows = [
        q[c] if j < n else [1.0] * vocab for c, j in zip(prefixes, itertools.cycle(range(n + 1)))
    ]
    logq = torch.tensor(q_rows, dtype=torch.float64).log().float()
    seeds = (torch.arange(TRIALS, dtype=torch.long) * 7919 + 11).repeat_interleave(n + 1)
    positions = (ANCHOR + 1 + torch.arange(n + 1)).repeat(TRIALS)
    keys = noise_keys(seeds, positions, NoisePurpose.SAMPLE)
    targets = (logp + gumbel_from_hash(counter_hash(keys, torch.arange(vocab)))).argmax(-1)
    proposals = torch.cat([drafts, torch.full((TRIALS, 1), -1)], 1).reshape(-1)
    verdict = verify(
        VerifyRows(
            processed=logp.to(device),
            targets=targets.to(device),
            proposals=proposals.to(device),
            draft_logits=logq.to(device),
            rejection=(proposals >= 0).to(device),
            seeds=seeds.to(device),
            positions=positions.to(device),
            lengths=[n] * TRIALS,
            sampled_rule="block",
        )
    )
    assert verdict.accepted == [len(e) - 1 for e in verdict.emitted]
    return list(zip(map(tuple, drafts.tolist()), map(tuple, verdict.emitted), strict=True))


def _chi2_pvalue(observed: Counter, probs: dict) -> float:
    """Pearson goodness of fit over (drafts, emitted) cells, cells expecting < 5 pooled (any
    observation outside the support fails)."""
    total = sum(observed.values())
    assert set(observed) <= set(probs), set(observed) - set(probs)
    cells = [(observed.get(k, 0), v * total) for k, v in probs.items()]
    big = [(o, e) for o, e in cells if e >= 5]
    small = [(o, e) for o, e in cells if e < 5]
    if small:
        big.append((sum(o for o, _ in small), sum(e for _, e in small)))
    stat = sum((o - e) ** 2 / e for o, e in big if e > 0)
    dof = len(big) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def _joint(p: Tree, q: Tree, vocab: int, n: int, **variant) -> dict:
    return {
        (drafts, emitted): q_prob * prob
        for drafts, q_prob in _draft_sequences(q, vocab, n)
        for emitted, prob in _block_outcomes(p, q, drafts, **variant).items()
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_verify_draws_the_block_rule_outcomes(n: int, device: str) -> None:
    """The implementation's (drafts, emitted) frequencies fit the exact probabilities; the
    unweighted-residual variant's probabilities are rejected by the same data (power)."""
    vocab = 4
    p, q = _tree(vocab, GAMMA, 17, zeros=False)  # the residuals differ a lot (power)
    observed = Counter(_verify_trials(p, q, vocab, n, device))
    assert _chi2_pvalue(observed, _joint(p, q, vocab, n)) > 1e-3
    if n >= 2:
        wrong = _joint(p, q, vocab, n, weighted_residual=False)
        assert _chi2_pvalue(observed, wrong) < 1e-6


def test_block_draft_seeds_are_fresh_per_step_and_independent_of_the_batch_row() -> None:
    """Drafts of a block-verified request at one position get new noise at every anchor (the
    last step's block decision read them), and the same noise in any batch row."""
    seeds = torch.tensor([5, 5, 5, -3, 1 << 62], dtype=torch.long)
    anchors = torch.tensor([10, 11, 12, 10, 10], dtype=torch.long)
    got = block_draft_seeds(seeds, anchors)
    assert len(set(got.tolist())) == 5
    flipped = block_draft_seeds(seeds.flip(0), anchors.flip(0))
    assert torch.equal(flipped, got.flip(0))
