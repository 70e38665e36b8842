"""The learner's ranks, behind one interface: a learner alone (``SingleRank``) or one of N
data-parallel ranks (``learner.distributed.DataParallel``, docs/explanation/learner-ranks.md). The learner core
and shell call the same methods either way; a single rank answers them on its own.

    ranks = SingleRank(algo)                       # or DataParallel.from_env(algo, ...)
    published = ranks.broadcast(published)         # rank 0's value everywhere
    ranks.settle(consumer, topic, partitions, explicit)   # start-up: a disjoint share each
    if ranks.agree(buffered, paused, need).train:  # one decision per poll, all ranks together
        metrics = ranks.update(batch, n_local)     # one update of the whole group
        shares = ranks.gather(what_rank_0_publishes)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Agreement:
    train: bool
    stop: bool


class Ranks(Protocol):
    """What the learner asks of its ranks (``SingleRank``, ``DataParallel``)."""

    publisher: bool
    """This rank writes the group's PolicyVersion and GradientStep events (rank 0)."""
    follows_foreign_versions: bool
    """A version of the policy published by another process (``rlstream rollback``) is adopted
    (off while ranks run: docs/explanation/learner-ranks.md)."""
    stopping: bool
    broken: bool
    uneven_updates: int

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def gather(self, obj: Any) -> list[Any]: ...

    def agree(self, pending: int, paused: bool, train_batch_size: int) -> Agreement: ...

    def update(self, batch: Any, n_local: int) -> dict[str, float]: ...

    def settle(self, consumer: Any, topic: str, partitions: Callable[[], int], explicit: dict | None) -> None: ...


class SingleRank:
    """A learner alone: every collective is the identity, the update is ``algo.update``."""

    publisher = True
    follows_foreign_versions = True
    stopping = False
    broken = False
    uneven_updates = 0
    rank, world = 0, 1

    def __init__(self, algo: Any) -> None:
        self.algo = algo

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def agree(self, pending: int, paused: bool, train_batch_size: int) -> Agreement:
        return Agreement(not paused and pending >= max(1, train_batch_size), False)

    def update(self, batch: Any, n_local: int) -> dict[str, float]:
        return self.algo.update(batch)

    def settle(self, consumer: Any, topic: str, partitions: Callable[[], int], explicit: dict | None) -> None:
        """Nothing to share: the consumer starts where it was told."""
