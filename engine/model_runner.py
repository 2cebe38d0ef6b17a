"""ModelRunner: a `SchedulerOutput` → tensors → model forward → sampling → a `ModelOutput`.

The runner owns the device state (`ModelState`: window rings, paged global KV, pending pairs,
token history) sized by the cache config, and the grammar state of constrained requests
(`GrammarTracker`, created at the first constrained request so that unconstrained serving never
imports xgrammar); nothing about request lifecycles: slots and block ids come from the
scheduler's plain-data output, and `release` is told which requests finished.

One step: build the batch → start the grammar mask fill → forward → apply the mask → sample →
advance the matchers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from engine.kv_cache import KVCacheManager
from engine.kv_cache.hashing import namespace_fingerprint
from engine.kv_cache.reuse import PrefixReuse, PrefixReuseConfig
from engine.models import DeepseekV41ForCausalLM, StepBatch, ints_to_device
from engine.models.deepseek_v41.state import write_token_history
from engine.outputs import (
    ModelOutput,
    SamplingInfo,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
)
from engine.sampler import Sampler, SamplingBatch

if TYPE_CHECKING:
    from engine.structured.tracker import GrammarTracker

LOGPROB_FLOOR = -9999.0


def build_prefix_reuse(
    model: DeepseekV41ForCausalLM, kv_manager: KVCacheManager, swa_replay: str
) -> PrefixReuse | None:
    """The scheduler's prefix-cache collaborator for this model (None when the manager has no
    prefix cache): namespace fingerprint, replay length and Engram history from the model."""
    if kv_manager.prefix_cache is None:
        return None
    cfg = model.config
    replay = model.replay_tokens(swa_replay)
    if replay < cfg.sliding_window - 1:
        raise ValueError(
            f"a {replay}-token replay cannot rebuild a {cfg.sliding_window}-token window"
        )
    config = PrefixReuseConfig(
        fingerprint=namespace_fingerprint(model.prefix_cache_namespace(swa_replay)),
        replay_tokens=replay,
        num_history_tokens=cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0,
        block_tokens=kv_manager.config.block_tokens,
    )
    return PrefixReuse(config, kv_manager)


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        num_slots: int,
        num_blocks: int,
        *,
        overlap_grammar_mask: bool = True,
    ) -> None:
        """overlap_grammar_mask: fill a step's grammar bitmask on a worker thread while the
        forward runs (False: fill it on the step's thread before the forward)."""
        self.model = model
        self.device = model.device
        self.state = model.allocate_state(num_slots, num_blocks)
        self.sampler = Sampler()
        self.overlap_grammar_mask = overlap_grammar_mask
        self.grammar: GrammarTracker | None = None

    def release(self, request_ids: list[str]) -> None:
        """Forget what the runner holds for finished requests (their grammar matchers)."""
        if self.grammar is not None:
            self.grammar.release(request_ids)

    def _grammar_for(self, infos: list[SamplingInfo]) -> GrammarTracker | None:
        if self.grammar is None and any(info.constraint is not None for info in infos):
            from engine.structured.tracker import GrammarTracker

            self.grammar = GrammarTracker(
                self.model.config.vocab_size, overlap=self.overlap_grammar_mask
            )
        return self.grammar

    def build_batch(self, output: SchedulerOutput) -> StepBatch:
        """Flat token ids, per-chunk offsets, positions, slots, block tables, logit rows."""
        chunks = output.chunks
        flat = [t for c in chunks for t in c.token_ids]
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c.token_ids))
        width = max(1, max(len(c.block_table) for c in chunks))
        tables = [[*c.block_table, *[-1] * (width - len(c.block_table))] for c in chunks]
        sampled_rows = [starts[i + 1] - 1 for i, c in enumerate(chunks) if c.sampling is not None]
        dev = self.device
        replaying = any(c.restore is not None for c in chunks)
        return StepBatch(
            token_ids=ints_to_device(flat, dev),
            starts=starts,
            start_positions=[c.start_position for c in chunks],
            slots=ints_to_device([c.slot for c in chunks], dev),
            block_tables=ints_to_device(tables, dev),
            logits_indices=ints_to_device(sampled_rows, dev),
            window_floors=[c.restore.window_floor if c.restore else 0 for c in chunks]
            if replaying
            else None,
            reuse_ends=[c.restore.num_reused_tokens if c.restore else 0 for c in chunks]
            if replaying
            else None,
        )

    def invalid_chunks(self, output: SchedulerOutput) -> dict[str, str]:
        """Request id -> why its chunk cannot run: a token id outside the vocabulary in its
        tokens or its sampling parameters (it would fail the whole step). No mutation."""
        vocab_size = self.model.config.vocab_size
        return {
            c.request_id: problem
            for c in output.chunks
            if (problem := _token_id_problem(c, vocab_size)) is not None
        }

    def restore_token_history(self, output: SchedulerOutput) -> None:
        """Give sequences restored from the prefix cache the token history (Engram's n-gram
        context) of the positions they did not compute."""
        for chunk in output.chunks:
            restore = chunk.restore
            if restore is not None and chunk.start_position == restore.window_floor:
                first = restore.window_floor - len(restore.history_token_ids)
                write_token_history(self.state, chunk.slot, first, list(restore.history_token_ids))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Run one step; sample the next token of every chunk that reaches its request's end.

        Chunks that `invalid_chunks` refuses are left out of the step and reported in
        `ModelOutput.failed`; the others run as if they were alone.
        """
        failed = self.invalid_chunks(output)
        if failed:
            chunks = tuple(c for c in output.chunks if c.request_id not in failed)
            output = dataclasses.replace(
                output, chunks=chunks, num_tokens=sum(len(c.token_ids) for c in chunks)
            )
            return dataclasses.replace(self._execute_valid(output), failed=failed)
        return self._execute_valid(output)

    def _execute_valid(self, output: SchedulerOutput) -> ModelOutput:
        if output.is_empty:
            return ModelOutput(sampled={}, logprobs={})
        batch = self.build_batch(output)
        sampled_chunks = [c for c in output.chunks if c.sampling is not None]
        infos = [c.sampling for c in sampled_chunks]
        request_ids = [c.request_id for c in sampled_chunks]
        grammar = self._grammar_for(infos)
        pending_mask = grammar.start_mask(request_ids, infos) if grammar is not None else None
        self.restore_token_history(output)
        step = self.model.forward_step(batch, self.state)
        if not sampled_chunks:
            return ModelOutput(sampled={}, logprobs={})
        if grammar is not None:
            grammar.apply_mask(pending_mask, step.logits)
        sampling = SamplingBatch.from_infos(
            infos,
            self.model.config.vocab_size,
            self.device,
            eos_token_id=self.model.config.eos_token_id,
        )
        result = self.sampler.sample(step.logits, sampling)
        token_ids = result.token_ids.tolist()  # the step's one device → host sync
        if grammar is not None:
            grammar.commit(request_ids, infos, token_ids)
        sampled = {c.request_id: [t] for c, t in zip(sampled_chunks, token_ids, strict=True)}
        logprobs: dict[str, list[TokenLogprob]] = {}
        if result.logprobs is not None:
            chosen = result.logprobs.tolist()
            top_ids = result.top_ids.tolist() if result.top_ids is not None else None
            top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
            for row, chunk in enumerate(sampled_chunks):
                k = chunk.sampling.params.num_logprobs
                if not chunk.sampling.params.logprobs:
                    continue
                top = ()
                if k and top_ids is not None and top_lps is not None:
                    # Alternatives removed by top-k/top-p/min-p have logprob −inf; JSON has no
                    # infinity, so they are reported at a floor, as vLLM does.
                    lps = [max(lp, LOGPROB_FLOOR) for lp in top_lps[row][:k]]
                    top = tuple(zip(top_ids[row][:k], lps, strict=True))
                chosen_lp = max(chosen[row], LOGPROB_FLOOR)
                logprobs[chunk.request_id] = [TokenLogprob(token_ids[row], chosen_lp, top)]
        return ModelOutput(sampled=sampled, logprobs=logprobs)


def _token_id_problem(chunk: ScheduledChunk, vocab_size: int) -> str | None:
    """Which field of a chunk holds a token id outside [0, vocab_size), or None."""
    fields: list[tuple[str, object]] = [("prompt token ids", chunk.token_ids)]
    if chunk.sampling is not None:
        params = chunk.sampling.params
        fields += [
            ("logit_bias", params.logit_bias.keys()),
            ("stop_token_ids", params.stop_token_ids),
            ("banned_token_ids", params.banned_token_ids),
            ("thinking_budget", params.thinking_budget.token_ids if params.thinking_budget else ()),
        ]
    for name, ids in fields:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
    return None
