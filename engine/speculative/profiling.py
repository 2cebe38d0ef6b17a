"""Start-up profiling of the step-time table with the model's own forwards (`dspark.md` §3.4).

`ModelForwards` gives `profile_step_times` its two callables on a scratch state: up to
`max_requests` sequences at `context_len` positions (one real prefill, its window rings and
token history copied to every slot, one shared block table so the global KV is read at the
full context without a copy per sequence). Rows written past the context are scratch.
`build_scheduled_planner(model)` builds the scheduled planner: on CUDA with graphs it loads the
table cached for (GPU, config, tiers, buckets, context) or profiles it; in eager mode (no CUDA
graphs, e.g. the CPU) there is no table and the planner verifies all (§3.6).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine import envs
from engine.models import StepBatch
from engine.models.deepseek_v41.state import BLOCK_TOKENS
from engine.speculative.planner import ScheduledPlanner, ScheduledPlannerConfig
from engine.speculative.step_times import (
    ProfileConfig,
    TableKey,
    config_hash,
    load_or_profile,
    profile_step_times,
)

log = logging.getLogger(__name__)

ROWS_PER_REQUEST_MAX = 6  # anchor + five drafts


class ModelForwards:
    """Draft and verify forwards for profiling (see the module docstring)."""

    def __init__(self, model, max_requests: int, context_len: int) -> None:
        if max_requests < 1 or context_len < 1:
            raise ValueError("max_requests and context_len must be ≥ 1")
        self.model, self.device = model, model.device
        self.max_requests, self.context_len = max_requests, context_len
        blocks = (context_len + ROWS_PER_REQUEST_MAX * 2) // BLOCK_TOKENS + 1
        self.state = model.allocate_state(max_requests, blocks)
        self.tables = torch.arange(blocks, device=self.device)[None].expand(max_requests, -1)
        vocab = min(model.config.vocab_size, 100_000)
        gen = torch.Generator(device="cpu").manual_seed(0)
        prompt = torch.randint(3, vocab, (context_len,), generator=gen).to(self.device)
        with torch.inference_mode():
            first = torch.zeros(1, dtype=torch.long, device=self.device)
            batch = StepBatch(prompt, [0, context_len], [0], first, self.tables[:1])
            model.forward_step(batch, self.state)
            state = self.state
            for rings in (state.swa, state.draft_swa):
                for ring in rings:
                    ring[1:] = ring[0]
            for pending in state.pending.values():
                pending[1:] = pending[0]
            state.tokens[1:] = state.tokens[0]
        ids = torch.randint(3, vocab, (max_requests * ROWS_PER_REQUEST_MAX,), generator=gen)
        self.token_ids = ids.to(self.device)
        self.slots = torch.arange(max_requests, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run_draft(self, n: int) -> None:
        n = min(n, self.max_requests)
        positions = torch.full((n,), self.context_len, device=self.device)
        self.model.draft(self.token_ids[:n], positions, self.slots[:n], self.state)

    @torch.inference_mode()
    def run_verify(self, m: int, n: int) -> None:
        """m rows over n requests (at most 6 each: fewer rows when m > 6·n)."""
        n = min(n, self.max_requests, m)
        lengths = [min(ROWS_PER_REQUEST_MAX, m // n + (i < m % n)) for i in range(n)]
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        batch = StepBatch(
            token_ids=self.token_ids[: starts[-1]],
            starts=starts,
            start_positions=[self.context_len] * n,
            slots=self.slots[:n],
            block_tables=self.tables[:n],
        )
        self.model.forward_step(batch, self.state).logits.argmax(-1)


def model_tiers(model, max_rows: int) -> tuple[int, ...] | None:
    """The token buckets the model's verify forwards pad to (its CUDA graphs), up to the first
    one ≥ `max_rows`; None in eager mode."""
    graphs = getattr(model.layers[0], "graphs", None) if len(model.layers) else None
    if graphs is None:
        return None
    buckets = graphs.attention_in.buckets
    kept = [b for b in buckets if b < max_rows]
    kept += [b for b in buckets if b >= max_rows][:1]
    return tuple(kept)


def build_scheduled_planner(
    model,
    num_speculative_tokens: int | None = None,
    *,
    max_requests: int = 256,
    context_len: int = 8192,
    cache_dir: Path | None = None,
    config: ScheduledPlannerConfig | None = None,
) -> ScheduledPlanner:
    """The scheduled planner for `model` (`--speculative-verify scheduled`).

    With CUDA graphs: the step-time table over the model's graph buckets up to 6·max_requests
    rows and request buckets up to max_requests, cached under `cache_dir` (default
    `$DEEPINFER_CACHE_DIR/step_times`), profiled on a miss. Eager mode, or a failed profile:
    no table, so every step verifies all (one warning when planning starts).
    """
    k = num_speculative_tokens or model.config.dspark_block_size
    tiers = model_tiers(model, ROWS_PER_REQUEST_MAX * max_requests)
    if tiers is None:
        log.info("eager mode: no step-time table, the scheduled planner verifies every draft")
        return ScheduledPlanner(None, k, config)
    buckets = tuple(b for b in tiers if b < max_requests) + (max_requests,)
    name = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    key = TableKey(name, config_hash(model.config), tiers, buckets, context_len)

    def profile():
        forwards = ModelForwards(model, max_requests, context_len)
        profile_config = ProfileConfig(max_requests=max_requests)
        return profile_step_times(
            forwards.run_draft, forwards.run_verify, tiers, buckets, profile_config,
            sync=forwards.sync,
        )  # fmt: skip

    folder = cache_dir or envs.cache_dir() / "step_times"
    table = load_or_profile(folder, key, profile)
    if table is not None:
        log.info(
            "step-time table: %d tiers up to %d rows, α %.4f ms/request, T(%d, %d) = %.2f ms",
            len(tiers), tiers[-1], table.alpha_ms, max_requests, tiers[-1],
            table.step_ms(max_requests, tiers[-1]),
        )  # fmt: skip
    return ScheduledPlanner(table, k, config)
