"""Pure stream processors (no I/O): reorder -> staleness -> importance, wired by ``pipeline``."""

from streams.processors.importance import ImportanceResult, ImportanceWeights, LogpFn, PolicyBuildError, PolicyLogpFn
from streams.processors.pipeline import (
    Output,
    Prepare,
    PrepareConfig,
    ProcessorStats,
    Rejection,
)
from streams.processors.reorder import ReorderBuffer, ReorderResult, ReorderStats, SeenIds
from streams.processors.staleness import PolicyStalenessError, StalenessDecision, StalenessWindow

__all__ = [
    "ImportanceResult", "ImportanceWeights", "LogpFn", "Output", "PolicyBuildError",
    "PolicyLogpFn", "PolicyStalenessError", "Prepare", "PrepareConfig", "ProcessorStats", "Rejection",
    "ReorderBuffer", "ReorderResult", "ReorderStats", "SeenIds", "StalenessDecision", "StalenessWindow",
]
