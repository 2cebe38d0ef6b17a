"""`ParallelConfig`: how many engine ranks, on how many machines, meeting where."""

from __future__ import annotations

from dataclasses import dataclass

from engine.distributed.groups import DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class ParallelConfig:
    """The engine's ranks (`scaleout.md` §2.1): one process per device, `ep_size` in all.

    ep_size: ranks of the EP group, all nodes together (1: the in-process engine). Each rank is
        also an attention-DP rank with its own scheduler, KV and requests.
    nnodes / node_rank: machines and this machine's index; each runs `ep_size / nnodes` ranks.
        Node 0 runs the API server; the other nodes run ranks only.
    master_addr / master_port: node 0's address; torch.distributed meets on `master_port`,
        the API process listens for its ranks on `master_port + 1` (`engine_port`). None (one
        node only): free ports chosen at start.
    timeout_s: how long a collective waits for a missing rank before every rank gives up.
    engine_process: with ep_size 1, run the one rank in a process of its own instead of the
        API process (the in-process engine's choices: async scheduling, step graphs, warm-up;
        no collectives), so the API's event loop and the engine's host work do not share
        one interpreter lock.
    """

    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    engine_process: bool = False

    def __post_init__(self) -> None:
        if self.engine_process and self.ep_size != 1:
            raise ValueError("engine_process is for one rank (--ep 1); --ep N already runs N")
        if self.ep_size < 1 or self.nnodes < 1:
            raise ValueError(f"ep_size and nnodes must be >= 1, got {self.ep_size}, {self.nnodes}")
        if self.ep_size % self.nnodes:
            raise ValueError(
                f"ep_size ({self.ep_size}) must be a multiple of nnodes ({self.nnodes}): "
                "every node runs the same number of ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is outside [0, {self.nnodes})")
        if self.master_port is None and self.nnodes > 1:
            raise ValueError("several nodes need an explicit master_port (the same on every node)")
        if self.master_port is not None and not 0 < self.master_port < 65535:
            raise ValueError(f"master_port must be a TCP port below 65535, got {self.master_port}")
        if not self.master_addr:
            raise ValueError("master_addr must not be empty")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def ranks_per_node(self) -> int:
        return self.ep_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def engine_port(self) -> int:
        if self.master_port is None:
            raise ValueError("no master_port: the ports are chosen at start")
        return self.master_port + 1
