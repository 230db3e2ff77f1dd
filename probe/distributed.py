"""Many processes under ``torchrun``: which sentences are mine, and one exact merge to rank 0.

Data parallel analysis needs no scheduler of its own. torchrun (or Slurm's srun with the same
environment) starts one process per GPU or CPU share; each streams the sentences whose index is
its rank modulo the number of processes, and the analyses' states, which are sums and keyed
samples, are merged into rank 0's with ``merge`` over torch.distributed. Rank 0 alone finishes
and writes the report. Every random choice is keyed to the sentence (``probe.keys``), so the
tables do not depend on how many processes shared the corpus.

A process that fails exits with its one-line error; torchrun then stops the others (SIGTERM),
which stop with theirs, and no report is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, Self

from probe.errors import ProbeError


class Mergeable(Protocol):
    def merge(self, other: Self) -> None:
        """Add the state of ``other``, which saw other sentences, exactly."""


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among those of one run (torchrun's environment variables)."""

    rank: int = 0  # RANK: 0 … size-1 over every node
    size: int = 1  # WORLD_SIZE
    local_rank: int = 0  # LOCAL_RANK: 0 … local_size-1 on this node
    local_size: int = 1  # LOCAL_WORLD_SIZE

    @classmethod
    def from_environment(cls) -> Ranks:
        """The ranks torchrun set; a single process when it did not."""
        get = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
        size = get("WORLD_SIZE", 1)
        if size == 1:
            return cls()
        return cls(
            rank=get("RANK", 0),
            size=size,
            local_rank=get("LOCAL_RANK", 0),
            local_size=get("LOCAL_WORLD_SIZE", 1),
        )

    @property
    def leader(self) -> bool:
        """Rank 0: the process that merges, finishes and writes."""
        return self.rank == 0

    @property
    def shard(self) -> tuple[int, int]:
        """``(rank, size)``: this process takes the items whose index is ``rank`` modulo
        ``size``."""
        return self.rank, self.size

    def gpus(self, n_gpus: int) -> list[int]:
        """The GPUs of this node that this process holds: one each when there are as many
        processes as GPUs, a group of ``n_gpus // local_size`` consecutive ones when a model
        copy spans several (``--device-map`` under torchrun)."""
        share = n_gpus // self.local_size
        if share == 0:
            raise ProbeError(
                f"{self.local_size} processes on this node but {n_gpus} GPU(s); start at most "
                "one process per GPU (torchrun --nproc-per-node)"
            )
        return list(range(self.local_rank * share, (self.local_rank + 1) * share))


@contextmanager
def joined(ranks: Ranks, device: str) -> Iterator[None]:
    """The process group of the run, for the duration of the block (nothing for one process).

    Collectives on GPUs go through NCCL, and everything else (the merge of analysis states,
    which live in CPU memory) through gloo.
    """
    if ranks.size == 1:
        yield
        return
    import torch.distributed as dist

    backend = "gloo"
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)  # NCCL works on the current device: this process's own
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def merge_to_leader(parts: Sequence[Mergeable], ranks: Ranks) -> Sequence[Mergeable] | None:
    """Merge every process's ``parts`` into rank 0's, exactly; returns them on rank 0 and None
    elsewhere.

    A binary tree: in round k, rank r receives from rank r + 2ᵏ and merges, in a fixed order, so
    that each process holds at most two states at once and the merge takes ⌈log₂ size⌉ rounds.
    Each part is sent pickled (``Analysis.__getstate__`` leaves out the model and what was only
    needed for one batch).
    """
    if ranks.size == 1:
        return parts
    import torch.distributed as dist

    step = 1
    while step < ranks.size:
        if ranks.rank % (2 * step) == step:
            dist.send_object_list([list(parts)], dst=ranks.rank - step)
            return None
        if ranks.rank % (2 * step) == 0 and ranks.rank + step < ranks.size:
            received: list[Any] = [None]
            try:
                dist.recv_object_list(received, src=ranks.rank + step)
            except RuntimeError as e:  # gloo and NCCL say so when the peer is gone
                raise ProbeError(
                    f"process {ranks.rank + step} of the run stopped before sending its share "
                    "(see its error); no report was written"
                ) from e
            for mine, theirs in zip(parts, received[0], strict=True):
                mine.merge(theirs)
        step *= 2
    return parts


class Tally(dict):
    """Counters by name (values are ints or nested ``Tally``s) that merge by adding."""

    def merge(self, other: Tally) -> None:
        for name, value in other.items():
            if isinstance(value, dict):
                self.setdefault(name, Tally()).merge(value)
            else:
                self[name] = self.get(name, 0) + value
