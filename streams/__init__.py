"""Stream processing: topics, the bus, the processors, and the two processor shells.

``faust -A streams worker`` imports this package and takes ``app``: an entry point, so it is
the one name here that reaches up, to the composition root (``rlstream.entry.faust_app``), and
only when Faust asks for it. Co-located mode never imports Faust.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "app":
        from rlstream.entry import faust_app  # entry hook (docs/architecture.md)

        return faust_app()
    raise AttributeError(f"module 'streams' has no attribute {name!r}")
