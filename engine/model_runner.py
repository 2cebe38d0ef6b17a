"""ModelRunner: a `SchedulerOutput` → tensors → model forward → sampling → a `ModelOutput`.

The runner owns the device state (`ModelState`: window rings, paged global KV, pending pairs,
token history) sized by the cache config, and the grammar state of constrained requests
(`GrammarTracker`, created at the first constrained request so that unconstrained serving never
imports xgrammar); nothing about request lifecycles: slots and block ids come from the
scheduler's plain-data output, and `release` is told which requests finished.

One step: build the batch → start the grammar mask fill → forward → apply the mask → sample →
advance the matchers. The step comes in three phases so that an async engine can overlap them
with the host work of its neighbours: `launch` (batch, mask fill, forward, and the sampling
when it needs no host tokens of the step before), `sample` (the rest), `collect` (the one
device → host sync, matchers advance). `execute` runs them back to back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import zlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.kv_cache import KVCacheManager
from engine.kv_cache.hashing import namespace_fingerprint
from engine.kv_cache.host import DONE, CopyHandle, HostBlockPool, HostPoolConfig
from engine.kv_cache.resume import ResumeSlots, ResumeTier
from engine.kv_cache.resume_dir import PointerDirectory, RemoteSlots
from engine.kv_cache.reuse import HostTier, PrefixReuse, PrefixReuseConfig, StoreTiers
from engine.kv_cache.store.dirstore import DirBlockStore, DirStoreConfig
from engine.kv_cache.store.tiers import BlockTiers
from engine.kv_cache.store.ttl import TTLPolicy
from engine.models import DeepseekV41ForCausalLM, StepBatch, ints_to_device
from engine.models.deepseek_v41.block_layout import BlockLayout
from engine.models.deepseek_v41.state import (
    ModelState,
    export_slot,
    import_slot,
    write_token_history,
)
from engine.outputs import (
    PLACEHOLDER_TOKEN_ID,
    ModelOutput,
    SamplingInfo,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
)
from engine.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRowCache
from engine.step_budget import num_leading_rows

if TYPE_CHECKING:
    from engine.speculative.config import SpeculativeConfig
    from engine.speculative.drafts import DraftFactory, DraftSource
    from engine.speculative.step import SpeculativeStep
    from engine.structured.tracker import GrammarTracker

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class DirTiersConfig:
    """The directory tiers to build (`engine/kv_cache/store/`): store configs fastest first,
    the TTL policy, and how long a request may wait for its blocks."""

    stores: tuple[DirStoreConfig, ...]
    policy: TTLPolicy
    load_timeout_s: float = 2.0


class RunnerBlockPayloads:
    """Pool blocks of a `ModelState` in the canonical block layout (`BlockPayloads` for
    `PrefixReuse`): to and from bytes (directory tiers) and host slots (host tier); called on
    the engine thread between steps.

    On CUDA, `save` gathers the blocks and copies them to the host on a side stream that
    first waits for the work queued so far; the compute stream waits only for the gather (a
    device-side wait, so later pool writes never overtake it), not for the host copy.
    `restore` copies and scatters on the compute stream, so the next step sees the blocks.
    """

    def __init__(self, state: ModelState, layout: BlockLayout) -> None:
        self.state = state
        self.layout = layout
        self.payload_len = layout.payload_len
        self.device = next(iter(state.global_kv.values())).device
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def export(self, blocks: Sequence[int]) -> list[bytes]:
        if not blocks:
            return []
        rows = self.layout.gather(self.state, blocks).cpu()
        return [row.numpy().tobytes() for row in rows]

    def load(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
        for block, payload in zip(blocks, payloads, strict=True):
            self.layout.from_bytes(self.state, block, payload)

    def save(self, blocks: Sequence[int], slots: Sequence[torch.Tensor]) -> CopyHandle:
        if self._side is None:
            for slot, row in zip(slots, self.layout.gather(self.state, blocks), strict=True):
                slot.copy_(row)
            return DONE
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            rows = self.layout.gather(self.state, blocks)
            gathered = torch.cuda.Event()
            gathered.record(self._side)
            for slot, row in zip(slots, rows, strict=True):
                slot.copy_(row, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        main.wait_event(gathered)
        return _EventHandle(done)

    def restore(self, slots: Sequence[torch.Tensor], blocks: Sequence[int]) -> CopyHandle:
        if self._side is None:
            self.layout.scatter(self.state, blocks, torch.stack(list(slots)))
            return DONE
        staging = torch.empty(len(slots), self.payload_len, dtype=torch.uint8, device=self.device)
        for row, slot in zip(staging, slots, strict=True):
            row.copy_(slot, non_blocking=True)
        self.layout.scatter(self.state, blocks, staging)
        done = torch.cuda.Event()
        done.record()
        return _EventHandle(done)


class _EventHandle:
    """A copy on a CUDA stream, done when its event is."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def is_done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class HostSlotPayload:
    """A resume-slot snapshot in host memory (`state.export_slot`; pinned on CUDA). The
    device → host copy may still be running: `checksum` waits for it."""

    def __init__(self, buffer: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        self.buffer = buffer
        self._copied = copied

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def checksum(self) -> int:
        if self._copied is not None:
            self._copied.synchronize()
        return zlib.crc32(self.buffer.numpy())

    def is_ready(self) -> bool:
        return self._copied is None or self._copied.query()

    def to_bytes(self) -> bytes:
        if self._copied is not None:
            self._copied.synchronize()
        return self.buffer.numpy().tobytes()


class RunnerSlotPayloads:
    """State slots of a `ModelState` to host snapshots (`SlotPayloads` for `ResumeTier`);
    called on the engine thread between steps."""

    def __init__(self, state: ModelState) -> None:
        self.state = state

    def export(self, slot: int, tail_block: int | None) -> HostSlotPayload:
        buffer = export_slot(self.state, slot, tail_block)
        copied = None
        if self.state.tokens.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return HostSlotPayload(buffer, copied)

    def from_bytes(self, data: bytes) -> HostSlotPayload:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.state.tokens.device.type == "cuda":
            buffer = buffer.pin_memory()
        return HostSlotPayload(buffer, None)


def build_prefix_reuse(
    model: DeepseekV41ForCausalLM,
    kv_manager: KVCacheManager,
    swa_replay: str,
    *,
    state: ModelState | None = None,
    dir_tiers: DirTiersConfig | None = None,
    host_bytes: int = 0,
    resume_slot_bytes: int = 0,
    resume_slot_url: str | None = None,
) -> PrefixReuse | None:
    """The scheduler's prefix-cache collaborator for this model (None when the manager has no
    prefix cache): namespace fingerprint, replay length and Engram history from the model;
    with the runner's `state`, a host tier of `host_bytes` (0: none) and the directory tiers
    of `dir_tiers` under the GPU tier, and resume slots of finished sequences in
    `resume_slot_bytes` (0: none), shared with the servers of the shared directory tier
    through pointer files naming `resume_slot_url` (this server's base URL) when both are
    given. Raises ValueError for a host budget below one block."""
    if kv_manager.prefix_cache is None:
        return None
    cfg = model.config
    replay = model.replay_tokens(swa_replay)
    decoder_tail = model.decoder_tail_tokens(swa_replay)
    for rows in (replay, decoder_tail or replay):
        if rows < cfg.sliding_window - 1:
            raise ValueError(
                f"a {rows}-row replay cannot rebuild a {cfg.sliding_window}-token window"
            )
    namespace = model.prefix_cache_namespace(swa_replay)
    config = PrefixReuseConfig(
        fingerprint=namespace_fingerprint(namespace),
        replay_tokens=replay,
        num_history_tokens=cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0,
        block_tokens=kv_manager.config.block_tokens,
        decoder_tail_tokens=decoder_tail,
    )
    store = host = None
    wants_tiers = host_bytes > 0 or (dir_tiers is not None and bool(dir_tiers.stores))
    if wants_tiers and state is None:
        raise ValueError("host and directory tiers need the runner's model state")
    if state is not None and wants_tiers:
        codecs = model.codecs
        payloads = RunnerBlockPayloads(state, BlockLayout.of(state, codecs.global_kv, codecs.index))
    if host_bytes > 0:
        pin = payloads.device.type == "cuda"
        pool = HostBlockPool(HostPoolConfig(host_bytes, payloads.payload_len, pin_memory=pin))
        host = HostTier(pool, payloads)
    if dir_tiers is not None and dir_tiers.stores:
        stores = [
            DirBlockStore(
                store_config,
                fingerprint=config.fingerprint,
                namespace_fields=namespace,
                payload_len=payloads.payload_len,
                policy=dir_tiers.policy,
            )
            for store_config in dir_tiers.stores
        ]
        store = StoreTiers(BlockTiers(stores), payloads, dir_tiers.load_timeout_s)
    resume = None
    if resume_slot_bytes > 0:
        if state is None:
            raise ValueError("resume slots need the runner's model state")
        shared = [s for s in (dir_tiers.stores if dir_tiers else ()) if s.tier == "shared"]
        remote = None
        if shared and resume_slot_url is not None:
            directory = PointerDirectory(shared[0].root, resume_slot_url)
            remote = RemoteSlots(directory, dir_tiers.load_timeout_s)
        resume = ResumeTier(
            ResumeSlots(resume_slot_bytes),
            RunnerSlotPayloads(state),
            kv_manager.config.block_tokens,
            remote,
        )
    return PrefixReuse(config, kv_manager, store, host, resume)


@dataclass(frozen=True)
class ReplayRows:
    """Rows the runner computed for prefix-cache replays since start, by layer stack
    (`model.md` §1.3): cached positions (below the hit) recomputed through the encoder
    layers and through the decoder layers, and rows of replaying chunks that skipped the
    decoder (decoder bounded replay, `model.md` §7.1)."""

    encoder: int = 0
    decoder: int = 0
    decoder_skipped: int = 0

    def add(self, chunk: ScheduledChunk) -> ReplayRows:
        """These counts plus those of one scheduled chunk (itself when it does not replay)."""
        restore = chunk.restore
        if restore is None:
            return self
        start = chunk.start_position
        end = start + len(chunk.token_ids)
        first_decoder = max(start, _decoder_floor(chunk))
        cached_end = min(end, restore.num_reused_tokens)
        return ReplayRows(
            self.encoder + max(0, cached_end - start),
            self.decoder + max(0, cached_end - first_decoder),
            self.decoder_skipped + first_decoder - start,
        )


def _decoder_floor(chunk: ScheduledChunk) -> int:
    """The position a chunk's decoder layers start at and floor their windows at."""
    restore = chunk.restore
    if restore is None:
        return 0
    if not restore.decoder_tail:
        return restore.window_floor
    end = chunk.start_position + len(chunk.token_ids)
    return max(restore.window_floor, end - restore.decoder_tail)


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        num_slots: int,
        num_blocks: int,
        *,
        overlap_grammar_mask: bool = True,
        speculative: SpeculativeConfig | None = None,
        draft_source: DraftSource | None = None,
        draft_factory: DraftFactory | None = None,
        step_graphs: bool = False,
    ) -> None:
        """overlap_grammar_mask: fill a step's grammar bitmask on a worker thread while the
        forward runs (False: fill it on the step's thread before the forward).
        speculative: with an enabled config every step runs `SpeculativeStep` (drafts from
        `draft_source`, else `draft_factory(model, state)` over this runner's state, by default
        the model's DSpark drafter).
        step_graphs: replay decode steps from one CUDA graph per step shape (`step_graph.py`;
        the state reserves a scratch slot and block for their padding rows)."""
        self.model = model
        self.device = model.device
        self.state = model.allocate_state(num_slots, num_blocks, reserve_scratch=step_graphs)
        self.step_graphs = model.enable_step_graphs(self.state) if step_graphs else None
        self._block_tables = BlockTableRows(num_slots, self.device)
        self.sampler = Sampler()
        self._sampling_rows = SamplingRowCache()
        self.overlap_grammar_mask = overlap_grammar_mask
        self.grammar: GrammarTracker | None = None
        self.replay_rows = ReplayRows()  # advanced by every step that replays
        self.speculative: SpeculativeStep | None = None
        if speculative is not None and speculative.is_enabled:
            from engine.speculative.drafts import DSparkDrafts
            from engine.speculative.step import SpeculativeStep

            source = draft_source or (draft_factory or DSparkDrafts)(model, self.state)
            self.speculative = SpeculativeStep(speculative, source)

    def release(self, request_ids: list[str]) -> None:
        """Forget what the runner holds for finished requests (their grammar matchers)."""
        if self.grammar is not None:
            self.grammar.release(request_ids)

    def grammar_for(self, infos: list[SamplingInfo]) -> GrammarTracker | None:
        if self.grammar is None and any(info.constraint is not None for info in infos):
            from engine.structured.tracker import GrammarTracker

            self.grammar = GrammarTracker(
                self.model.config.vocab_size, overlap=self.overlap_grammar_mask
            )
        return self.grammar

    def build_batch(
        self, output: SchedulerOutput, previous: StepInFlight | None = None
    ) -> StepBatch:
        """Flat token ids, per-chunk offsets, positions, slots, block tables, logit rows; a
        placeholder (always a chunk's last token) takes `previous`'s sampled id on the device."""
        chunks = output.chunks
        flat: list[int] = []
        starts = [0]
        holes: list[int] = []  # flat indices of placeholders (a chunk's last token)
        hole_requests: list[str] = []
        sampled_rows = []
        replaying = decoder_tail = False
        for c in chunks:
            token_ids = c.token_ids
            flat.extend(token_ids)
            end = starts[-1] + len(token_ids)
            starts.append(end)
            if PLACEHOLDER_TOKEN_ID in token_ids:
                first = end - len(token_ids)
                for i, token in enumerate(token_ids):
                    if token == PLACEHOLDER_TOKEN_ID:
                        holes.append(first + i)
                        hole_requests.append(c.request_id)
            if c.sampling is not None:
                sampled_rows.append(end - 1)
            if c.restore is not None:
                replaying = True
                decoder_tail = decoder_tail or bool(c.restore.decoder_tail)
        dev = self.device
        slots = [c.slot for c in chunks]
        token_ids = ints_to_device(flat, dev)
        if holes:
            token_ids = _fill_placeholders(token_ids, holes, hole_requests, previous)
        return StepBatch(
            token_ids=token_ids,
            starts=starts,
            start_positions=[c.start_position for c in chunks],
            slots=ints_to_device(slots, dev),
            block_tables=self._block_tables.rows(chunks),
            logits_indices=ints_to_device(sampled_rows, dev),
            window_floors=[c.restore.window_floor if c.restore else 0 for c in chunks]
            if replaying
            else None,
            reuse_ends=[c.restore.num_reused_tokens if c.restore else 0 for c in chunks]
            if replaying
            else None,
            decoder_floors=[_decoder_floor(c) for c in chunks] if decoder_tail else None,
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

    def restore_resume_slots(self, output: SchedulerOutput) -> None:
        """Copy the resume slots of requests resumed in this step into their state slots and
        tail blocks (before the forward reads them)."""
        for chunk in output.chunks:
            if chunk.resume is not None:
                import_slot(
                    self.state, chunk.slot, chunk.resume.tail_block, chunk.resume.payload.buffer
                )

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
        `ModelOutput.failed`; the others run as if they were alone. Synchronous: the three
        phases of `launch` → `sample` → `collect` back to back. With speculation, the
        speculative step (`engine/speculative/step.py`), which may sample several tokens.
        """
        if self.speculative is not None:
            return self.speculative.execute(self, output)
        step = self.launch(output)
        self.sample(step)
        return self.collect(step)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, previous: StepInFlight | None = None) -> StepInFlight:
        """Start a step's forward on the device; also its sampling unless that needs tokens of
        `previous` on the host (`StepInFlight.needs_host_tokens`), which `sample` then waits for.

        previous: the step still in flight, whose device-side sampled ids replace the
        `PLACEHOLDER_TOKEN_ID` entries of `output` (the ids never visit the host first).
        Raises RuntimeError with speculation on (its steps run through `execute`).
        """
        if self.speculative is not None:
            raise RuntimeError("speculative decoding runs synchronous steps (execute)")
        failed = self.invalid_chunks(output)
        if failed:
            chunks = tuple(c for c in output.chunks if c.request_id not in failed)
            output = dataclasses.replace(
                output, chunks=chunks, num_tokens=sum(len(c.token_ids) for c in chunks)
            )
        step = StepInFlight(output, failed, on_cuda=self.device.type == "cuda")
        if output.is_empty:
            return step
        parts = split_decode_rows(output) if self.step_graphs is not None else (output,)
        batches = [self.build_batch(part, previous) for part in parts]
        for chunk in output.chunks:
            self.replay_rows = self.replay_rows.add(chunk)
        infos = [c.sampling for c in step.sampled_chunks]
        grammar = self.grammar_for(infos)
        if grammar is not None and not step.needs_host_tokens:
            step.pending_mask = grammar.start_mask(step.request_ids, infos)
        self.restore_resume_slots(output)
        self.restore_token_history(output)
        with step.timed():
            logits = [self.forward(batch) for batch in batches]
            step.logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        if not step.needs_host_tokens:
            self.sample(step)
        return step

    def sampling_batch(self, infos: Sequence[SamplingInfo]) -> SamplingBatch:
        """The sampling metadata of a step's rows on the device (row i samples `infos[i]`);
        what each request's parameters contribute is kept from the step before."""
        return SamplingBatch.from_infos(
            infos,
            self.model.config.vocab_size,
            self.device,
            eos_token_id=self.model.config.eos_token_id,
            rows_cache=self._sampling_rows,
        )

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The step's logits: replayed from its step graph when it has one, else
        `forward_step`."""
        logits = None if self.step_graphs is None else self.step_graphs.run(batch)
        return self.model.forward_step(batch, self.state).logits if logits is None else logits

    @torch.inference_mode()
    def sample(
        self,
        step: StepInFlight,
        previous_tokens: Mapping[str, int] | None = None,
        dropped: Collection[str] = (),
    ) -> None:
        """Sample `step` (a no-op when `launch` already did) and start copying the ids to the
        host. previous_tokens: the previous step's sampled id by request (`collect`ed), which
        fills placeholders in penalty histories; dropped: requests that finished since
        `step` was scheduled: their rows are sampled without grammar and their ids discarded.
        """
        if step.is_sampled or step.logits is None or not step.sampled_chunks:
            step.is_sampled = True
            return
        infos = [_resolve(c, previous_tokens or {}, dropped) for c in step.sampled_chunks]
        step.dropped = frozenset(dropped)
        grammar = self.grammar_for(infos)
        if grammar is not None:
            if step.pending_mask is None:
                step.pending_mask = grammar.start_mask(step.request_ids, infos)
            grammar.apply_mask(step.pending_mask, step.logits)
        sampling = self.sampling_batch(infos)
        with step.timed():
            result = self.sampler.sample(step.logits, sampling)
            step.device_token_ids = result.token_ids
            step.result = _to_host(result)
        step.infos = infos
        step.is_sampled = True

    def collect(self, step: StepInFlight, dropped: Collection[str] = ()) -> ModelOutput:
        """Wait for `step`'s sampled ids on the host (its one device → host sync), advance the
        grammar matchers of its rows not `dropped` (nor dropped at `sample`), and return them."""
        if step.result is None:
            return ModelOutput(sampled={}, logprobs={}, failed=step.failed)
        step.wait()
        result = step.result
        token_ids = result.token_ids.tolist()
        chunks = step.sampled_chunks
        if self.grammar is not None:
            skip = step.dropped | set(dropped)
            kept = [i for i, c in enumerate(chunks) if c.request_id not in skip]
            self.grammar.commit(
                [step.request_ids[i] for i in kept],
                [step.infos[i] for i in kept],
                [token_ids[i] for i in kept],
            )
        sampled = {c.request_id: [t] for c, t in zip(chunks, token_ids, strict=True)}
        logprobs = token_logprobs(result, token_ids, chunks, [(1, 1)] * len(chunks))
        return ModelOutput(sampled=sampled, logprobs=logprobs, failed=step.failed)


def token_logprobs(
    result: SamplerOutput,
    token_ids: Sequence[int],
    chunks: Sequence[ScheduledChunk],
    counts: Sequence[tuple[int, int]],
) -> dict[str, list[TokenLogprob]]:
    """The logprob entries of the chunks that asked for them. Rows are chunk-major: chunk i owns
    `counts[i][0]` consecutive rows of `result` (row r sampled `token_ids[r]`), of which the
    first `counts[i][1]` emitted a token (speculation: one row per committed token)."""
    if result.logprobs is None:
        return {}
    chosen = result.logprobs.tolist()
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    logprobs: dict[str, list[TokenLogprob]] = {}
    first = 0
    for chunk, (num_rows, num_emitted) in zip(chunks, counts, strict=True):
        rows = range(first, first + num_emitted)
        first += num_rows
        params = chunk.sampling.params
        if not params.logprobs:
            continue
        k = params.num_logprobs
        entries = []
        for row in rows:
            top = ()
            if k and top_ids is not None and top_lps is not None:
                # Alternatives removed by top-k/top-p/min-p have logprob −inf; JSON has no
                # infinity, so they are reported at a floor, as vLLM does.
                lps = [max(lp, LOGPROB_FLOOR) for lp in top_lps[row][:k]]
                top = tuple(zip(top_ids[row][:k], lps, strict=True))
            entries.append(TokenLogprob(token_ids[row], max(chosen[row], LOGPROB_FLOOR), top))
        logprobs[chunk.request_id] = entries
    return logprobs


class StepInFlight:
    """One step launched on the device and not yet collected (see `ModelRunner.launch`).

    `device_token_ids` holds the sampled ids on the device (row i: `sampled_chunks[i]`), which
    the next step reads for its placeholders; `result` the copies bound for the host.
    """

    def __init__(
        self, output: SchedulerOutput, failed: dict[str, str], *, on_cuda: bool = False
    ) -> None:
        self.output = output
        self.on_cuda = on_cuda
        self.failed = failed
        self.sampled_chunks = [c for c in output.chunks if c.sampling is not None]
        self.request_ids = [c.request_id for c in self.sampled_chunks]
        self.row_of = {rid: row for row, rid in enumerate(self.request_ids)}
        self.logits: torch.Tensor | None = None
        self.pending_mask: Any = None
        self.infos: list[SamplingInfo] = []
        self.dropped: frozenset[str] = frozenset()
        self.device_token_ids: torch.Tensor | None = None
        self.result: SamplerOutput | None = None
        self.is_sampled = False
        self._events: list[torch.cuda.Event] = []  # CUDA: around the forward and the sampling
        self._host_seconds = 0.0  # CPU: the same phases, timed on the host

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time a phase of the step's device work (CUDA events, or the host clock on the CPU)."""
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events += [start, end]
        else:
            started = time.perf_counter()
            yield
            self._host_seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Block until the step's device work (and the copies of its ids to the host) is done."""
        if self._events:
            self._events[-1].synchronize()

    @property
    def device_seconds(self) -> float:
        """Device time of the step's forward and sampling (valid after `wait`), without the
        time it queued behind the step before it: what the step budget's time model fits."""
        pairs = zip(self._events[::2], self._events[1::2], strict=True)
        return self._host_seconds + sum(a.elapsed_time(b) for a, b in pairs) / 1000.0

    def fail(self, failed: dict[str, str]) -> None:
        """Mark the step as not run: `collect` reports `failed` and samples nothing; the next
        step's placeholders get id 0 (their requests are finished by this step's update)."""
        self.failed = {**self.failed, **failed}
        self.logits = self.device_token_ids = self.result = None
        self.is_sampled = True

    @property
    def needs_host_tokens(self) -> bool:
        """True when a row's sampling reads its previous token on the host: a grammar mask (the
        matcher must accept it first) or a penalty history ending in a placeholder. Such a
        step is sampled only after the previous one is collected. (A thinking budget's forced
        draw is not here: the scheduler never runs that row ahead of its outputs.)"""
        return any(
            c.token_ids[-1] == PLACEHOLDER_TOKEN_ID
            and (c.sampling.constraint is not None or c.sampling.history is not None)
            for c in self.sampled_chunks
        )


def _resolve(
    chunk: ScheduledChunk, previous_tokens: Mapping[str, int], dropped: Collection[str]
) -> SamplingInfo:
    """The chunk's `SamplingInfo` with its history's placeholder filled from `previous_tokens`;
    a dropped row (its request finished, its token is discarded) loses its grammar, whose
    matcher is gone, and fills the placeholder with any valid id."""
    info = chunk.sampling
    is_dropped = chunk.request_id in dropped
    history = info.history
    if history and history[-1] == PLACEHOLDER_TOKEN_ID:
        token = 0 if is_dropped else previous_tokens[chunk.request_id]
        info = dataclasses.replace(info, history=(*history[:-1], token))
    if is_dropped and info.constraint is not None:
        info = dataclasses.replace(info, constraint=None)
    return info


def _to_host(result: SamplerOutput) -> SamplerOutput:
    """`result` copied to pinned host memory without waiting (CUDA); itself on the CPU. The
    copies are valid after `StepInFlight.wait`."""
    if not result.token_ids.is_cuda:
        return result

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    return SamplerOutput(
        copy(result.token_ids),
        copy(result.logprobs),
        copy(result.top_ids),
        copy(result.top_logprobs),
    )


def split_decode_rows(output: SchedulerOutput) -> tuple[SchedulerOutput, ...]:
    """A step's work as the forwards that run it with step graphs: a step that mixes decode
    rows (its leading chunks of one token) with longer chunks is two, the decode rows and the
    rest, in that order (their sampled rows concatenate to the step's); any other step is one.

    One forward of a mixed step pads every decode row to the longest chunk in the attention's
    and the indexer's [sequences, longest chunk, ...] tensors and cannot replay a step graph;
    apart, the decode rows replay their graph and the chunks pad only among themselves.
    Sequences are independent, so the split changes no result beyond the rounding of other
    matmul shapes."""
    chunks = output.chunks
    split = num_leading_rows(len(c.token_ids) for c in chunks)
    if split in (0, len(chunks)):
        return (output,)
    return (
        dataclasses.replace(output, chunks=chunks[:split], num_tokens=split),
        dataclasses.replace(output, chunks=chunks[split:], num_tokens=output.num_tokens - split),
    )


def _fill_placeholders(
    token_ids: torch.Tensor,
    holes: list[int],
    hole_requests: list[str],
    previous: StepInFlight | None,
) -> torch.Tensor:
    """`token_ids` with the flat positions `holes` set to the ids `previous` sampled for their
    requests (`hole_requests`), gathered on the device.

    NOTE: a placeholder whose request has no sampled row in `previous` (its chunk failed there)
    gets id 0: that request is finished by the previous step's `update`, which then ignores
    this chunk."""
    if previous is None or previous.device_token_ids is None:
        sources = torch.zeros(len(holes), dtype=torch.long, device=token_ids.device)
    else:
        # One extra 0 after the previous step's rows, for requests it has no row of.
        padded = torch.cat([previous.device_token_ids, previous.device_token_ids.new_zeros(1)])
        missing = len(previous.request_ids)
        row_of = previous.row_of
        rows = [row_of.get(rid, missing) for rid in hole_requests]
        sources = padded[ints_to_device(rows, token_ids.device)]
    token_ids[ints_to_device(holes, token_ids.device)] = sources
    return token_ids


class BlockTableRows:
    """The runner's host copy of the block tables by state slot, so that a step's `[B, width]`
    table tensor is one gather instead of B padded lists.

    Row s holds the last table a chunk of slot s carried, padded with −1. A row is rewritten
    only when a chunk carries another table object than the one it holds (the manager hands
    out one snapshot per table until it grows, `KVCacheManager.block_table`); the snapshot
    itself is kept, so its identity is never reused while it is compared."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        self._host = torch.full((num_slots, 8), -1, dtype=torch.long)
        self._held: list[tuple[int, ...] | None] = [None] * num_slots

    def rows(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """`[len(chunks), max(1, longest table)]` int64 on the device: each chunk's table, −1
        past its end."""
        width = 1
        for c in chunks:
            table = c.block_table
            if len(table) > width:
                width = len(table)
            if self._held[c.slot] is not table:
                self._write(c.slot, table)
        index = torch.tensor([c.slot for c in chunks], dtype=torch.long)
        gathered = self._host[:, :width].index_select(0, index)
        return ints_to_device(gathered, self.device)

    def _write(self, slot: int, table: tuple[int, ...]) -> None:
        if len(table) > self._host.shape[1]:
            wider = max(len(table), 2 * self._host.shape[1])
            grown = torch.full((self._host.shape[0], wider), -1, dtype=torch.long)
            grown[:, : self._host.shape[1]] = self._host
            self._host = grown
        row = self._host[slot]
        row.fill_(-1)
        if table:
            row[: len(table)] = torch.tensor(table, dtype=torch.long)
        self._held[slot] = table


def _token_id_problem(chunk: ScheduledChunk, vocab_size: int) -> str | None:
    """Which field of a chunk holds a token id outside [0, vocab_size), or None."""
    known_ids = [t for t in chunk.token_ids if t != PLACEHOLDER_TOKEN_ID]
    fields: list[tuple[str, object]] = [("prompt token ids", known_ids)]
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
