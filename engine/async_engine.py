"""AsyncEngine: the in-process engine the API server calls.

One background task drives `EngineCore.step()` in a worker thread, so the event loop never blocks
on model compute. Requests and aborts arrive from the event loop at any time; they are queued and
applied between steps (the scheduler is only ever touched by one thread at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.choices import fan_out, stream_choices
from engine.core import EngineCore, internal_error_message
from engine.distributed.memory import (
    check_plan,
    describe_held,
    free_memory_bytes,
    plan_weights,
)
from engine.kv_cache import CacheConfig, KVCacheManager, PrefixCache
from engine.kv_cache.host import DEFAULT_HOST_FRACTION, default_host_bytes
from engine.kv_cache.store.dirstore import DirStoreConfig
from engine.kv_cache.store.ttl import DEFAULT_TTL_SPEC, TTLPolicy
from engine.model_runner import DirTiersConfig, ModelRunner, build_prefix_reuse
from engine.models import DeepseekV41ForCausalLM, Numerics, load_model
from engine.models.deepseek_v41.config import preset_names
from engine.models.deepseek_v41.engram_store import ENGRAM_PLACEMENTS as ENGRAM_PLACEMENTS
from engine.models.deepseek_v41.engram_store import resolve_engram_placement
from engine.models.deepseek_v41.state import ModelState, slot_payload_len
from engine.models.deepseek_v41.warm_up import serving_warm_up_steps, warm_up
from engine.models.embedded import resolve_model_source
from engine.outputs import Delta
from engine.overlap import OverlappedCore
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from engine.speculative.overlap import OverlappedSpeculativeCore
from engine.speculative.scheduling import DraftScheduling, build_planner
from engine.step_budget import (
    CPU_TIME_PRIOR,
    CUDA_TIME_PRIOR,
    StepBudget,
    StepTimeModel,
    activation_cost,
)

if TYPE_CHECKING:
    from engine.speculative.drafts import DraftFactory, DraftSource
    from engine.structured import CompiledConstraint

logger = logging.getLogger(__name__)

# Target step time by device type when EngineConfig.target_step_ms is None.
DEFAULT_TARGET_STEP_MS = {"cpu": 2000.0, "cuda": 500.0}
# Share of the memory free after loading (host RAM on the CPU, device memory on CUDA) that one
# step's activations may use when EngineConfig.activation_memory_bytes is None.
ACTIVATION_MEMORY_FRACTION = 0.5
# About 1,300 full V4.1 slots of ~3 MB (`cache.md` §3.2): minutes of an agent fleet's turns.
DEFAULT_RESUME_SLOT_MEMORY = 4 << 30
KV_STORAGES = ("quantized", "exact")
DENSE_GEMMS = ("bf16", "fp8", "fp8-weights")
CUDA_GRAPH_MODES = ("segments", "step")


class EngineClosedError(RuntimeError):
    """The engine is shutting down and admits no new requests."""


class RequestRejectedError(ValueError):
    """A request that can never run on this engine (`AsyncEngine.check_request`)."""


AUTO_DTYPE = "auto"  # bfloat16 on CUDA (MXFP4 experts, grouped kernel, CUDA graphs), else float32


@dataclass(frozen=True)
class EngineConfig:
    """What `AsyncEngine.from_config` builds.

    model: a preset name (`tiny`, `default`, `medium`: random weights generated once into the
        cache folder) or a checkpoint folder / hub id.
    kv_cache_tokens: global-KV capacity in tokens (pool of 128-token blocks) shared by all
        running sequences; max_num_seqs also sizes the per-sequence window slots.
    max_model_len: context limit (default: the model's max_position_embeddings).
    overlap_grammar_mask: fill a step's grammar bitmask on a worker thread while its forward
        runs; None = only when the model is not on the CPU (a CPU forward already uses every
        core, so the fill would compete with it instead of hiding behind it).
    cuda_graphs: on CUDA, replay each block's pure parts from CUDA graphs in steps of up to 512
        tokens (`DeepseekV41ForCausalLM.enable_cuda_graphs`); False runs every step eagerly.
        Needs `quantized_experts` (bfloat16): otherwise a warning, and every step runs eagerly.
    cuda_graph_mode: with `cuda_graphs`, `segments` replays only those pure parts; `step`
        also replays every plain decode step whole from one CUDA graph per step shape, the
        attention's stateful middle included (`step_graph.py`; not with speculation, the
        batch-invariant mode, host Engram tables or expert parallelism, which keep
        `segments`, with a warning); None = `step` wherever it applies, else `segments`.
    target_step_ms: prefill chunks are sized so that a step's predicted time (a cost model
        fitted to the engine's own steps) stays within this; None = by device
        (`DEFAULT_TARGET_STEP_MS`).
    activation_memory_bytes: the activation memory one step may use (chunks are sized by the
        model's estimated bytes per step); None = `ACTIVATION_MEMORY_FRACTION` of the memory
        free once the model and its state are allocated.
    enable_prefix_caching: keep full KV blocks indexed after their requests finish and reuse
        them for later requests with the same prefix (`engine/kv_cache/reuse.py`).
    swa_replay: what a prefix hit recomputes (`DeepseekV41ForCausalLM.replay_tokens`):
        `bounded` (one block, approximate) or `exact` (equals a full prefill).
    async_scheduling: schedule step N+1 while step N runs (`engine/overlap.py`; with
        speculation `engine/speculative/overlap.py`; same tokens as without); None = only
        when the model is not on the CPU (a CPU forward keeps the host busy, so there is
        nothing to overlap it with), with or without speculation.
    kv_cache_dir / kv_cache_shared_dir: directory tiers under the GPU tier (a local SSD, a
        mount shared by several servers; either, both or none), with byte budgets
        `kv_cache_dir_bytes` / `kv_cache_shared_dir_bytes` (GC between 0.90 and 0.80 of them).
        Need `enable_prefix_caching`.
    kv_ttl: TTL per traffic class in the directory tiers (`agent=3d,chat=7d`).
    kv_load_timeout_s: the longest a request waits in the queue for its directory blocks.
    host_kv_cache_bytes: the host tier's budget (`engine/kv_cache/host.py`: blocks of the GPU
        tier copied to host memory, pinned on CUDA, LRU); 0 = no host tier; None =
        `DEFAULT_HOST_FRACTION` of the memory available at start (measured after the model
        loads), split between the ranks of one machine. Needs prefix caching.
    engram_placement: where the Engram tables live (`engram_store.py`): `device`, `host`
        (mapped from the checkpoint, one copy per node, rows gathered per step) or `auto`
        (host on the CPU or with several ranks, device for one CUDA rank).
    resume_slot_memory: host bytes for resume slots (`engine/kv_cache/resume.py`): the window
        rings, pending pairs, token history and partial last block of finished sequences, so
        that a prompt extending one (an agent's next turn) computes only its new tokens,
        exactly; least recently used first out. 0 = none; needs `enable_prefix_caching`.
    resume_slot_url: this server's base URL; with `kv_cache_shared_dir`, its slots are
        announced there by pointer files naming it, and slots of the other servers sharing the
        directory are pulled from them (`GET /internal/kv/slot/{id}`; `resume_dir.py`).
    speculative: `dspark` (draft with the checkpoint's DSpark drafter and verify several
        tokens per step, `engine/speculative/`) or `off`; None = `dspark` on CUDA when the
        model has the drafter and is a checkpoint folder, `off` on the CPU and for the
        embedded presets (`tiny`, `default`, `medium`): their weights are random, so their
        drafter accepts ~no draft and speculation only costs (docs/performance.md,
        2026-12-02: TPOT ~3x that of `off`); `dspark` still runs them when asked. With
        `async_scheduling` it runs `OverlappedSpeculativeCore` (`engine/speculative/overlap.py`).
    num_speculative_tokens: drafts per request and step (1 to the drafter's block, 5).
    speculative_verify: `fixed` verifies every draft; `scheduled` the planner's budget
        (`engine/speculative/planner.py`; without a step-time table, i.e. eager mode and the
        CPU, it verifies every draft too).
    speculative_acceptance: `rejection` or `block` (token-wise rejection sampling or block
        verification: sampled output has the non-speculative distribution) or `coupled`
        (seeded output is bit-identical to the non-speculative one).
    speculative_calibration: an STS calibration file for the confidence head (`python -m
        engine.speculative.sts fit`); refused when fitted for another draft count. None =
        identity. speculative_record: where steps that verified every draft append their
        (confidences, accepted) records for fitting one.
    kv_storage: `quantized` (window rows MXFP8, global rows and index keys FP4, the model's
        own storage) or `exact` (the compute dtype: a row's rounding differences from the
        batch's composition stay rounding-sized instead of flipping quantisation codes, so
        greedy tokens rarely move; bit-identical logits need `batch_invariant`; the lossless
        checks of speculation use it).
    dense_gemm: how the checkpoint's FP8 dense linears (attention projections, shared
        experts, indexer queries, Engram and DSpark projections) run: `bf16` dequantised to
        the compute dtype at load (the reference numerics), or `fp8` kept FP8 with their tile
        scales and multiplied on FP8 tensor cores with activations quantized per (row, 32
        columns) (`engine/models/deepseek_v41/dense.py`; half the bytes), or `fp8-weights`
        kept FP8 and multiplied with bf16 activations (W8A16: decode steps stream the FP8
        bytes, each weight decoded to the bf16 value of `bf16`, so the products are the same;
        `kernels/fp8_weight_gemm.py`). Both need CUDA and bfloat16; `fp8` also quantized KV
        storage (the exact storage is the reference mode).
    batch_invariant: a request's logits do not depend on the batch's composition, bit for
        bit (`Numerics.batch_invariant`: fixed-order matmuls, attention and indexer; slower).
    """

    model: str = "default"
    device: str = "cpu"
    dtype: str = AUTO_DTYPE  # resolved at construction (`AUTO_DTYPE`)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 32768
    kv_cache_tokens: int = 262144
    max_model_len: int | None = None
    overlap_grammar_mask: bool | None = None
    cuda_graphs: bool = True
    cuda_graph_mode: str | None = None
    target_step_ms: float | None = None
    activation_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    swa_replay: str = "bounded"
    async_scheduling: bool | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_bytes: int = 64 << 30
    kv_cache_shared_dir: str | None = None
    kv_cache_shared_dir_bytes: int = 1 << 40
    kv_ttl: str = DEFAULT_TTL_SPEC
    kv_load_timeout_s: float = 2.0
    host_kv_cache_bytes: int | None = None
    engram_placement: str = "auto"
    resume_slot_memory: int = DEFAULT_RESUME_SLOT_MEMORY
    resume_slot_url: str | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 5
    speculative_verify: str = "scheduled"
    speculative_acceptance: str = "rejection"
    kv_storage: str = "quantized"
    batch_invariant: bool = False
    speculative_calibration: str | None = None
    speculative_record: str | None = None
    dense_gemm: str = "bf16"

    def __post_init__(self) -> None:
        if self.dtype == AUTO_DTYPE:  # frozen: the resolved value replaces `auto` once
            on_cuda = torch.device(self.device).type == "cuda"
            object.__setattr__(self, "dtype", "bfloat16" if on_cuda else "float32")
        if self.host_kv_cache_bytes is not None and self.host_kv_cache_bytes < 0:
            raise ValueError("host_kv_cache_bytes must be >= 0")
        self.dir_tiers()  # raises ValueError for a bad directory-tier option
        resolve_engram_placement(self.engram_placement, self.device, 1)  # ValueError if unknown
        self.speculative_config(on_cuda=True, has_drafter=True)  # ValueError for bad options
        if self.kv_storage not in KV_STORAGES:
            raise ValueError(f"kv_storage must be one of {KV_STORAGES}, not {self.kv_storage!r}")
        if self.cuda_graph_mode is not None and self.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise ValueError(
                f"cuda_graph_mode must be one of {CUDA_GRAPH_MODES}, not {self.cuda_graph_mode!r}"
            )
        if self.swa_replay not in ("bounded", "exact"):
            raise ValueError(f"swa_replay must be bounded or exact, not {self.swa_replay!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.max_num_seqs < 1 or self.kv_cache_tokens < 128:
            raise ValueError("max_num_seqs must be >= 1 and kv_cache_tokens >= 128")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode row each)")
        if self.target_step_ms is not None and not self.target_step_ms > 0:
            raise ValueError(f"target_step_ms must be > 0, not {self.target_step_ms!r}")
        if self.activation_memory_bytes is not None and self.activation_memory_bytes <= 0:
            raise ValueError("activation_memory_bytes must be > 0")
        if self.resume_slot_memory < 0:
            raise ValueError("resume_slot_memory must be >= 0")
        self._check_dense_gemm()

    def _check_dense_gemm(self) -> None:
        if self.dense_gemm not in DENSE_GEMMS:
            raise ValueError(f"dense_gemm must be one of {DENSE_GEMMS}, not {self.dense_gemm!r}")
        if self.dense_gemm == "bf16":
            return
        if torch.device(self.device).type != "cuda" or self.dtype != "bfloat16":
            raise ValueError(
                f"--dense-gemm {self.dense_gemm} runs FP8 weights on the GPU's kernels: it needs "
                f"--device cuda and --dtype bfloat16 (got {self.device}, {self.dtype}); on the "
                "CPU use bf16"
            )
        if self.batch_invariant and self.dense_gemm == "fp8-weights":
            raise ValueError(
                "--batch-invariant runs every dense matmul in one fixed order; the FP8-weight "
                "GEMM's K splits follow the step's rows: use --dense-gemm bf16"
            )
        if self.dense_gemm != "fp8":
            return
        if self.kv_storage == "exact":
            raise ValueError(
                "--dense-gemm fp8 changes the model's numerics; --kv-storage exact (the "
                "reference, batch-invariant mode) keeps --dense-gemm bf16"
            )
        if self.batch_invariant:
            raise ValueError(
                "--batch-invariant runs every dense matmul in one fixed order; the FP8 GEMM "
                "has no such path yet: use --dense-gemm bf16"
            )

    @property
    def numerics(self) -> Numerics:
        """The model numerics these options select (`kv_storage`, `dense_gemm`,
        `batch_invariant`)."""
        return Numerics(
            kv_quantize=self.kv_storage == "quantized",
            dense_fp8=self.dense_gemm != "bf16",
            dense_fp8_activations=self.dense_gemm == "fp8",
            batch_invariant=self.batch_invariant,
        )

    def speculative_config(self, *, on_cuda: bool, has_drafter: bool) -> SpeculativeConfig:
        """The speculation these options select for this config's model on CUDA (or not) with
        (or without) the DSpark drafter. Raises ValueError for a bad value, or `dspark`
        without a drafter."""
        method = self.speculative
        if method is None:
            trained = self.model not in preset_names()  # the presets are random weights
            method = "dspark" if on_cuda and has_drafter and trained else "off"
        if method == "dspark" and not has_drafter:
            raise ValueError("--speculative dspark needs a checkpoint with the DSpark drafter")
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=self.num_speculative_tokens,
            verify=self.speculative_verify,
            acceptance=self.speculative_acceptance,
            calibration=self.speculative_calibration,
            record=self.speculative_record,
        )

    @property
    def quantized_experts(self) -> bool:
        """Routed experts stay MXFP4 (a quarter of the bytes; the grouped Triton kernel reads
        them): on CUDA in bfloat16. Elsewhere they are dequantised to `dtype`."""
        return torch.device(self.device).type == "cuda" and self.dtype == "bfloat16"

    @property
    def traffic_classes(self) -> tuple[str, ...]:
        """The traffic classes `kv_ttl` names (a request may ask for these only)."""
        return TTLPolicy.parse(self.kv_ttl).classes

    def dir_tiers(self) -> DirTiersConfig | None:
        """The directory tiers these options describe (None: none configured)."""
        stores = []
        for tier, root, budget in (
            ("local", self.kv_cache_dir, self.kv_cache_dir_bytes),
            ("shared", self.kv_cache_shared_dir, self.kv_cache_shared_dir_bytes),
        ):
            if root is not None:
                stores.append(DirStoreConfig(root=root, tier=tier, max_bytes=budget))
        policy = TTLPolicy.parse(self.kv_ttl)
        if not stores:
            return None
        if not self.enable_prefix_caching:
            raise ValueError("the KV cache directories need prefix caching enabled")
        if not self.kv_load_timeout_s >= 0:
            raise ValueError("kv_load_timeout_s must be >= 0")
        if len({os.path.realpath(s.root) for s in stores}) < len(stores):
            raise ValueError("--kv-cache-dir and --kv-cache-shared-dir must differ")
        return DirTiersConfig(tuple(stores), policy, self.kv_load_timeout_s)


def _log_resume_slots(config: EngineConfig, state: ModelState) -> int:
    """The resume-slot budget in bytes (0 without prefix caching), logged with a slot's size."""
    budget = config.resume_slot_memory if config.enable_prefix_caching else 0
    if budget:
        per_slot = slot_payload_len(state)
        logger.info(
            "resume slots: %.2f GiB of host memory (--resume-slot-memory), %d bytes per slot "
            "(about %d slots)",
            budget / (1 << 30),
            per_slot,
            budget // per_slot,
        )
    return budget


class AsyncEngine:
    def __init__(self, core: EngineCore, eos_token_id: int | None) -> None:
        self.core = core
        self.eos_token_id = eos_token_id
        self._streams: dict[str, asyncio.Queue[Delta]] = {}  # engine request id → its stream
        self._groups: dict[str, list[str]] = {}  # user request id → engine ids (n choices)
        self._pending: list[Callable[[], None]] = []  # applied between steps
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._stopping = False
        self.step_count = 0

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        model = load_engine_model(config)
        return cls.from_model(model, config)

    @classmethod
    def from_model(
        cls,
        model: DeepseekV41ForCausalLM,
        config: EngineConfig,
        *,
        draft_source: DraftSource | None = None,
        draft_factory: DraftFactory | None = None,
        num_local_ranks: int = 1,
    ) -> AsyncEngine:
        """The engine over `model`. The context limit is the configured (or the model's) one,
        lowered to the longest context whose steps fit the activation memory budget, so that
        the server refuses longer prompts at admission. draft_source: where speculative drafts
        come from (default: the model's DSpark drafter); draft_factory: builds it over the
        runner's state instead (tests; see `ModelRunner`). num_local_ranks: the engine ranks on
        this machine, which split the default host-tier budget."""
        cache = CacheConfig(num_blocks=config.kv_cache_tokens // 128, num_slots=config.max_num_seqs)
        kv_manager = KVCacheManager(cache, PrefixCache() if config.enable_prefix_caching else None)
        speculative = config.speculative_config(
            on_cuda=model.device.type == "cuda", has_drafter=model.mtp is not None
        )
        runner = ModelRunner(
            model,
            cache.num_slots,
            cache.num_blocks,
            overlap_grammar_mask=(
                model.device.type != "cpu"
                if config.overlap_grammar_mask is None
                else config.overlap_grammar_mask
            ),
            speculative=speculative,
            draft_source=draft_source,
            draft_factory=draft_factory,
            step_graphs=_uses_step_graphs(model, config, speculative.is_enabled),
        )
        step_budget = _step_budget(model, config, runner.step_graphs is not None)
        max_model_len = config.max_model_len or model.config.max_position_embeddings
        max_context = step_budget.max_context_len()
        if max_context is not None and max_context + 1 < max_model_len:
            logger.warning(
                "context limit lowered from %d to %d tokens: longer steps exceed the "
                "activation memory budget",
                max_model_len,
                max_context + 1,
            )
            max_model_len = max_context + 1
        logger.info("step budget: %s", step_budget.describe())
        if config.kv_cache_tokens < max_model_len:
            raise ValueError(
                f"kv_cache_tokens ({config.kv_cache_tokens}) cannot hold one sequence of "
                f"max_model_len ({max_model_len}) tokens; raise kv_cache_tokens or lower "
                "max_model_len"
            )
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
            ),
            kv_manager,
            step_budget,
            prefix_reuse=build_prefix_reuse(
                model,
                kv_manager,
                config.swa_replay,
                state=runner.state,
                dir_tiers=_log_dir_tiers(config.dir_tiers()),
                host_bytes=_host_bytes(config, num_local_ranks),
                resume_slot_bytes=_log_resume_slots(config, runner.state),
                resume_slot_url=config.resume_slot_url,
            ),
            speculation=(
                DraftScheduling(
                    speculative.num_speculative_tokens,
                    build_planner(speculative, model, config.max_num_seqs),
                )
                if speculative.is_enabled
                else None
            ),
        )
        overlapped = config.async_scheduling
        if overlapped is None:
            overlapped = model.device.type != "cpu"
        core_type = EngineCore
        if overlapped:
            core_type = OverlappedSpeculativeCore if speculative.is_enabled else OverlappedCore
        return cls(core_type(scheduler, runner), model.config.eos_token_id)

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """The step loop runs and new requests are admitted."""
        return self._task is not None and not self._task.done() and self._accepting

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; then let in-flight requests finish (drain) or abort them."""
        self._accepting = False
        if not drain:
            for request_id in list(self._streams):
                self._abort_later(request_id)
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                for request_id in list(self._streams):
                    self._abort_later(request_id)
                self._wakeup.set()
                await self._task
            self._task = None
        reuse = self.core.scheduler.prefix_reuse
        if reuse is not None:
            await asyncio.to_thread(reuse.close)

    def resume_slot_payload(self, slot_id: int, generation: int) -> bytes | None:
        """The bytes of the resume slot (id, generation) this engine holds, for another
        server's pull; None if it holds no such slot (evicted, reused or never). Safe while
        the engine steps (one dict read; a published payload never changes)."""
        reuse = self.core.scheduler.prefix_reuse
        if reuse is None or reuse.resume is None:
            return None
        slot = reuse.resume.pool.get(slot_id, generation)
        return None if slot is None else slot.payload.to_bytes()

    # ---- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        constraint: CompiledConstraint | None = None,
        cache_salt: str | None = None,
        traffic_class: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream the deltas of one user request (n choices, `Delta.index` tells which).

        cache_salt: the request shares prefix-cache blocks only with requests of the same salt.
        traffic_class: the TTL class of its blocks in the directory tiers (None: `chat`).

        constraint: a compiled grammar every choice's output must follow (its stop token must
        be the model's EOS); the grammar, not `min_tokens`, decides when an output may end.
        Leaving the iteration early (the consumer stops, is cancelled or disconnects) aborts
        every unfinished choice and frees what it held.

        Raises:
            EngineClosedError: the engine is shutting down.
            ValueError: a duplicate request id, or a constraint that does not fit the model
                (vocabulary size) or the request (`ignore_eos`).
        """
        if not self._accepting:
            raise EngineClosedError("the engine is shutting down")
        if constraint is not None:
            self._check_constraint(constraint, params)
        choices = fan_out(request_id, params)
        ids = [choice.request_id for choice in choices]
        if request_id in self._groups or any(rid in self._streams for rid in ids):
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        now = time.monotonic()
        requests = [
            Request(
                request_id=choice.request_id,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                seed=choice.seed,
                arrival_time=now,
                eos_token_id=self.eos_token_id,
                index=choice.index,
                constraint=constraint,
                cache_salt=cache_salt,
                traffic_class=traffic_class,
            )
            for choice in choices
        ]
        for rid in ids:
            self._streams[rid] = queue
        self._groups[request_id] = ids
        self._submit(lambda: self._add_all(requests))

        def release() -> None:
            self._groups.pop(request_id, None)
            for rid in ids:  # late deltas of aborted choices are dropped by _dispatch
                self._streams.pop(rid, None)

        stream = stream_choices(choices, queue, self._abort_later, release)
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield delta

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        """Refuse, before anything is streamed, a request `generate` would fail: one that can
        never run here (context length, KV pool, activation memory budget) or whose
        constraint does not fit. Reads only configuration: safe from the event loop.

        Raises:
            RequestRejectedError: why (a client error: the request must change).
        """
        reason = self.core.scheduler.rejection_reason(len(prompt_token_ids), params.max_tokens)
        if reason is None and constraint is not None:
            try:
                self._check_constraint(constraint, params)
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            raise RequestRejectedError(reason)

    def _check_constraint(self, constraint: CompiledConstraint, params: SamplingParams) -> None:
        vocab_size = self.core.runner.model.config.vocab_size
        if constraint.vocab_size != vocab_size:
            raise ValueError(
                f"the grammar's vocabulary ({constraint.vocab_size}) differs from the model's "
                f"({vocab_size})"
            )
        if params.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar (it ends at EOS)")

    def abort(self, request_id: str) -> None:
        """Cancel a request (or each choice `{id}-{i}` of an n > 1 request) at any stage."""
        for rid in self._groups.get(request_id, [request_id]):
            self._abort_later(rid)

    # ---- loop ---------------------------------------------------------------------------------

    def _submit(self, action: Callable[[], None]) -> None:
        self._pending.append(action)
        self._wakeup.set()

    def _add_all(self, requests: list[Request]) -> None:
        for request in requests:
            self.core.add_request(request)

    def _abort_one(self, request_id: str) -> None:
        self.core.abort(request_id)

    def _abort_later(self, request_id: str) -> None:
        self._submit(lambda: self._abort_one(request_id))

    def _apply_pending(self) -> None:
        actions, self._pending = self._pending, []
        for action in actions:
            action()

    def _dispatch(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            queue = self._streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _fail_all(self) -> None:
        """Finish every open stream with ABORT and a generic error naming its request (the
        exception is in the log); free the requests in the core."""
        for request_id, queue in list(self._streams.items()):
            request = self.core.scheduler.get_request(request_id)
            self.core.abort(request_id)
            queue.put_nowait(
                Delta(
                    request_id=request_id,
                    index=request.index if request else 0,
                    token_ids=[],
                    logprobs=None,
                    num_prompt_tokens=request.num_prompt_tokens if request else 0,
                    num_output_tokens=request.num_output_tokens if request else 0,
                    finish_reason=FinishReason.ABORT,
                    error=internal_error_message(request_id),
                )
            )
            self._streams.pop(request_id, None)

    async def _run(self) -> None:
        while True:
            self._apply_pending()
            if not self.core.has_work():
                if self._stopping:
                    return
                self._wakeup.clear()
                if self._pending:
                    continue
                await self._wakeup.wait()
                continue
            try:
                deltas = await asyncio.to_thread(self.core.step)
            except Exception:  # the scheduler failed (the core isolates runner failures)
                logger.exception("engine step failed outside the runner; aborting every request")
                self._fail_all()
                continue
            self.step_count += 1
            self._dispatch(deltas)
            if not deltas and self.core.scheduler.num_running == 0:
                await asyncio.sleep(0.002)  # only requests waiting for KV: do not spin


def _host_bytes(config: EngineConfig, num_local_ranks: int) -> int:
    """The host tier's budget of this rank (0: none), printed; the default is split between
    the `num_local_ranks` ranks of this machine."""
    if not config.enable_prefix_caching:
        return 0
    budget = config.host_kv_cache_bytes
    if budget is None:
        budget = default_host_bytes(num_local_ranks)
        how = f"default: {DEFAULT_HOST_FRACTION:.0%} of the memory available at start"
        if num_local_ranks > 1:
            how += f", split between the {num_local_ranks} ranks of this machine"
    else:
        how = "--host-kv-cache-bytes"
    logger.info(
        "KV cache host tier: %s (%s)", f"{budget / 2**30:.2f} GiB" if budget else "off", how
    )
    return budget


def _log_dir_tiers(tiers: DirTiersConfig | None) -> DirTiersConfig | None:
    """Print the directory tiers' settings at start (budgets, watermarks, TTLs)."""
    if tiers is not None:
        for store in tiers.stores:
            logger.info(
                "KV cache %s directory %s: budget %.1f GiB, GC from %.0f%% down to %.0f%%, "
                "free-space floor %.1f GiB",
                store.tier,
                store.root,
                store.max_bytes / 2**30,
                100 * store.high_watermark,
                100 * store.low_watermark,
                store.min_free_bytes / 2**30,
            )
        logger.info("KV cache TTLs: %s", tiers.policy.describe())
    return tiers


def _step_budget(
    model: DeepseekV41ForCausalLM, config: EngineConfig, decode_rows_apart: bool = False
) -> StepBudget:
    """The memory budget and step-time target of `config` on `model`'s device;
    decode_rows_apart: the runner splits mixed steps (step graphs)."""
    cfg, device = model.config, model.device
    memory_bytes = config.activation_memory_bytes or int(
        ACTIVATION_MEMORY_FRACTION * free_memory_bytes(device)
    )
    target_ms = config.target_step_ms or DEFAULT_TARGET_STEP_MS.get(device.type, 2000.0)
    memory = activation_cost(
        hidden_size=cfg.hidden_size,
        hc_mult=cfg.hc_mult,
        num_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        index_topk=cfg.index_topk,
        index_head_dim=cfg.index_head_dim,
        vocab_size=cfg.vocab_size,
    )
    prior = CUDA_TIME_PRIOR if device.type == "cuda" else CPU_TIME_PRIOR
    return StepBudget(
        memory,
        memory_bytes,
        StepTimeModel(prior),
        target_ms / 1000.0,
        decode_rows_apart=decode_rows_apart,
    )


def load_engine_model(config: EngineConfig) -> DeepseekV41ForCausalLM:
    """The configured model (`EngineConfig.quantized_experts` says how its routed experts are
    held); on CUDA the blocks' pure parts replay from CUDA graphs unless `cuda_graphs` is off.
    Raises `InsufficientMemoryError` before reading any tensor when the weights do not fit."""
    path = resolve_model_source(config.model)
    device = torch.device(config.device)
    plan = plan_weights(config, path, ep_size=1)
    check_plan(plan, device, 1)
    model = load_model(
        path,
        device=config.device,
        dtype=getattr(torch, config.dtype),
        quantized_experts=config.quantized_experts,
        engram_placement=plan.engram_placement,
        numerics=config.numerics,
    )
    logger.info("the engine holds its weights: %s", describe_held(model))
    capture_graphs(model, config)
    warm_up_kernels(model, config)
    return model


def warm_up_kernels(model: DeepseekV41ForCausalLM, config: EngineConfig) -> None:
    """On CUDA, run every launch shape serving meets once now (`warm_up.py`: Triton compiles
    each kernel variant on first use; after this, serving compiles nothing)."""
    if model.device.type != "cuda":
        return
    start = time.perf_counter()
    has_drafter = model.mtp is not None
    speculative = config.speculative_config(on_cuda=True, has_drafter=has_drafter)
    drafts = config.num_speculative_tokens if speculative.method == "dspark" else 0
    steps = serving_warm_up_steps(config.max_num_batched_tokens, config.max_num_seqs, drafts)
    warm_up(model, steps, drafts=drafts > 0)
    logger.info(
        "kernels warmed up for %d step shapes in %.1f s", len(steps), time.perf_counter() - start
    )


def _uses_step_graphs(
    model: DeepseekV41ForCausalLM, config: EngineConfig, speculating: bool
) -> bool:
    """`cuda_graph_mode` step applies: CUDA graphs on, MXFP4 experts (the only capturable
    MoE), no speculation (its steps verify several rows), not batch-invariant, no host
    Engram tables and one rank (`StepGraphs`; the EP collectives are not captured); asked
    for explicitly and not applicable, a warning says why it runs `segments`."""
    if config.cuda_graph_mode == "segments":
        return False
    blockers = {
        "CUDA graphs are off or not on CUDA": not config.cuda_graphs or model.device.type != "cuda",
        "the routed experts are dequantised (not bfloat16)": not model.quantized_experts,
        "speculative decoding is on": speculating,
        "batch-invariant numerics": model.numerics.batch_invariant,
        "the Engram tables are host-resident": bool(model.host_engram_tables()),
        "expert parallelism": model.expert_parallel is not None,
    }
    reasons = [why for why, applies in blockers.items() if applies]
    if reasons and config.cuda_graph_mode == "step":
        logger.warning("--cuda-graph-mode step runs as segments: %s", "; ".join(reasons))
    return not reasons


def capture_graphs(model: DeepseekV41ForCausalLM, config: EngineConfig) -> None:
    """On CUDA with `cuda_graphs`, capture the blocks' graphs for up to `max_num_seqs` tokens
    now; without MXFP4 experts (a float32 or float16 dtype) warn instead: the per-expert MoE
    reads each layer's expert counts on the host, so no capture could succeed."""
    if model.device.type != "cuda" or not config.cuda_graphs:
        return
    if not config.quantized_experts:
        logger.warning(
            "CUDA graphs off: --dtype %s dequantises the routed experts, whose per-expert "
            "path cannot be captured; --dtype bfloat16 keeps them MXFP4",
            config.dtype,
        )
        return
    start = time.perf_counter()
    model.enable_cuda_graphs()
    model.capture_cuda_graphs(config.max_num_seqs)
    failed = len(model.graph_failures())
    logger.info(
        "CUDA graphs captured at start for steps of up to %d tokens in %.1f s%s",
        config.max_num_seqs,
        time.perf_counter() - start,
        f" ({failed} block parts run eagerly: see the warnings)" if failed else "",
    )
