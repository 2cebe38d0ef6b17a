"""`BlockTiers`: the directory tiers under the GPU tier, as the engine sees them (`cache.md`
§2.4–§2.6). Reads, writes and touches run on worker threads; the engine thread only submits
jobs and polls them, so no engine step ever waits on a disk.

    engine thread                       worker threads
    ─────────────                       ──────────────
    start_load(blocks) ──► LoadJob ───► reader: each block from the first tier that has it
                                        (local, then shared), stop at the first miss; a block
                                        found only in the shared tier is promoted (written) to
                                        the local one; every hit touches that tier's copy
    poll job.payloads  ◄──────────────  appended block by block (a prefix is usable early)
    write_back(chain)  ──► per-store FIFO writer: items in order, parent before child; the
                                        chain stops at its first failed write (or missing
                                        parent): its later items are skipped and counted

Every failure is a miss or a skipped write, counted in the stores' stats; nothing here raises
into the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.kv_cache.store.dirstore import DirBlockStore
from engine.kv_cache.store.format import BlockIdentity
from engine.kv_cache.store.gc import GcWorker

logger = logging.getLogger(__name__)

_MAX_FAILED_CHAINS = 4096


@dataclass(frozen=True)
class WriteItem:
    """One block of a write-back chain: `payload` None means the block should exist already
    (a cache hit): it is only touched, and if it is missing the chain stops there."""

    block: BlockIdentity
    payload: bytes | None


class LoadJob:
    """A directory lookup of one request's missing blocks, filled by a reader thread.

    `payloads()` is the prefix loaded so far (block i of the job is `blocks[i]`); `tiers()`
    names the tier each came from. `done` is set when the reader stopped (all found, a miss,
    or `cancel`).
    """

    def __init__(self, blocks: Sequence[BlockIdentity], traffic_class: str) -> None:
        self.blocks = tuple(blocks)
        self.traffic_class = traffic_class
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._payloads: list[bytes] = []
        self._tiers: list[str] = []
        self._cancelled = False

    def payloads(self) -> list[bytes]:
        with self._lock:
            return list(self._payloads)

    def tiers(self) -> list[str]:
        with self._lock:
            return list(self._tiers)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True

    @property
    def is_cancelled(self) -> bool:
        with self._lock:
            return self._cancelled

    def _append(self, payload: bytes, tier: str) -> None:
        with self._lock:
            self._payloads.append(payload)
            self._tiers.append(tier)


class _Writer:
    """One store's FIFO write queue and its thread."""

    def __init__(self, store: DirBlockStore, max_queued: int) -> None:
        self.store = store
        self.jobs: queue.Queue[tuple[str, list[WriteItem], str] | None] = queue.Queue(max_queued)
        self.failed: OrderedDict[str, None] = OrderedDict()  # chains stopped by a failure
        self.dropped: dict[str, int] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=f"kv-{store.tier}-writer")
        self.thread.daemon = True
        self.thread.start()

    def submit(self, chain: str, items: list[WriteItem], traffic_class: str) -> None:
        try:
            self.jobs.put_nowait((chain, items, traffic_class))
        except queue.Full:
            self._mark_failed(chain)
            self._count("queue_full", len(items))

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                self._run(*job)
            except Exception:
                logger.exception("KV cache %s write-back failed", self.store.tier)
            finally:
                self.jobs.task_done()

    def _run(self, chain: str, items: list[WriteItem], traffic_class: str) -> None:
        for done, item in enumerate(items):
            with self.lock:
                stopped = chain in self.failed
            if stopped:
                self._count("parent_failed", len(items) - done)
                return
            if item.payload is None:
                ok = self.store.touch(item.block.key, item.block.depth, traffic_class)
                reason = "parent_missing"
            else:
                ok = self.store.write(item.block, item.payload, traffic_class)
                reason = "write_failed"
            if not ok:
                self._mark_failed(chain)
                self._count(reason, 1)

    def _mark_failed(self, chain: str) -> None:
        with self.lock:
            self.failed[chain] = None
            while len(self.failed) > _MAX_FAILED_CHAINS:
                self.failed.popitem(last=False)

    def _count(self, reason: str, num: int) -> None:
        with self.lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + num


class BlockTiers:
    """The configured directory tiers, fastest first (local SSD, then the shared mount).

    start_gc: run one background GC worker per store (tests drive `gc_once` themselves).
    """

    def __init__(
        self,
        stores: Sequence[DirBlockStore],
        *,
        num_readers: int = 2,
        max_queued_writes: int = 1024,
        start_gc: bool = True,
    ) -> None:
        if not stores:
            raise ValueError("BlockTiers needs at least one store")
        self.stores = tuple(stores)
        self._readers = ThreadPoolExecutor(num_readers, thread_name_prefix="kv-dir-reader")
        self._writers = {s.tier: _Writer(s, max_queued_writes) for s in self.stores}
        self._gc: list[GcWorker] = []
        if start_gc:
            for store in self.stores:
                worker = GcWorker(store.gc_once, store.config.gc_interval_s, f"kv-{store.tier}-gc")
                store.on_gc_needed = worker.wake
                worker.start()
                self._gc.append(worker)

    # ---------------------------------------------------------------- reads

    def start_load(self, blocks: Sequence[BlockIdentity], traffic_class: str) -> LoadJob:
        """Start reading `blocks` (a chain segment, in order) on a reader thread."""
        job = LoadJob(blocks, traffic_class)
        self._readers.submit(self._load, job)
        return job

    def _load(self, job: LoadJob) -> None:
        promote: list[WriteItem] = []
        try:
            for block in job.blocks:
                if job.is_cancelled:
                    break
                found = None
                for store in self.stores:
                    payload = store.read(block)
                    if payload is not None:
                        store.touch(block.key, block.depth, job.traffic_class)
                        found = (payload, store.tier)
                        break
                if found is None:
                    break
                job._append(*found)
                if found[1] != self.stores[0].tier:
                    promote.append(WriteItem(block, found[0]))
        except Exception:
            logger.exception("KV cache directory lookup failed")
        finally:
            job.done.set()
        if promote:  # into the faster tiers (only the local one sits above the shared one)
            first = promote[0].block
            self._writers[self.stores[0].tier].submit(
                f"promote-{first.key.hex()}", promote, job.traffic_class
            )

    def believes_present(self, block: BlockIdentity) -> bool:
        """Whether every store remembers an unexpired copy (no I/O)."""
        return all(s.remembers(block.key, s.clock()) for s in self.stores)

    # ---------------------------------------------------------------- writes

    def write_back(self, chain: str, items: list[WriteItem], traffic_class: str) -> None:
        """Queue a chain segment for every store (in chain order; the chain stops at its
        first failed item per store). A full queue drops the segment, counted."""
        if items:
            for writer in self._writers.values():
                writer.submit(chain, items, traffic_class)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (tests, shutdown). Returns False on timeout."""
        done = threading.Event()

        def wait_all() -> None:
            for writer in self._writers.values():
                writer.jobs.join()
            done.set()

        threading.Thread(target=wait_all, daemon=True).start()
        return done.wait(timeout)

    def writes_dropped(self) -> dict[str, dict[str, int]]:
        """Tier → reason → blocks not written (queue full, parent failed or missing)."""
        out = {}
        for tier, writer in self._writers.items():
            with writer.lock:
                out[tier] = dict(writer.dropped)
        return out

    def close(self) -> None:
        """Stop the GC workers and writers (after the queued writes) and the readers."""
        for worker in self._gc:
            worker.stop()
        for writer in self._writers.values():
            writer.jobs.put(None)
        for writer in self._writers.values():
            writer.thread.join(timeout=30)
        self._readers.shutdown(wait=True, cancel_futures=True)
