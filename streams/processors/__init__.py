"""Pure stream processors (no I/O): reorder -> staleness -> importance, wired by ``pipeline``."""

from streams.dedup import SeenIds
from streams.processors.importance import ImportanceResult, ImportanceWeights, LogpFn
from streams.processors.pipeline import (
    Output,
    Prepare,
    PrepareConfig,
    ProcessorStats,
    Rejection,
)
from streams.processors.reorder import ReorderBuffer, ReorderResult, ReorderStats
from streams.processors.staleness import PolicyStalenessError, StalenessDecision, StalenessWindow

__all__ = [
    "ImportanceResult", "ImportanceWeights", "LogpFn", "Output", "PolicyStalenessError", "Prepare", "PrepareConfig",
    "ProcessorStats", "Rejection",
    "ReorderBuffer", "ReorderResult", "ReorderStats", "SeenIds", "StalenessDecision", "StalenessWindow",
]
