"""Stream processing: topics, the bus, the processors, and the Faust app.

``faust -A streams worker`` imports this package and takes ``app``; the Faust app is built
lazily so that co-located mode (which runs the same processors in-process) never imports Faust.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "app":
        from streams.faust_app import app

        return app
    raise AttributeError(f"module 'streams' has no attribute {name!r}")
