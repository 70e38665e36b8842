"""Policy snapshot stores: versioned weights (+ optional learner state), no pickle.

A snapshot is one policy version::

    store = open_store("file:///data/snapshots")      # or "redis://redis:6379/0", "s3://bucket/prefix"
    ref = store.save(7, model.state_dict(), {"algo": "ppo", "step": 700},
                     state={"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 700})
    weights, meta = store.load(7)                      # sha256-verified
    state = store.load_state(7)                        # nested dict, tensors restored
    snap = rollback(store, 5)                          # weights of a known-good version

By idea: ``format`` (errors, ``SnapshotRef``, the tensor and record format, the same on every
backend), ``base`` (the ``SnapshotStore`` protocol; save, load, verify and retention over a
backend's few primitives), the backends ``local_dir``, ``redis_store`` and ``object_store`` (S3,
fsspec with s3fs), ``url`` (``open_store``: the store a URL names) and ``schedule`` (when the
learner snapshots, and ``rollback``).

One writer (the learner) per store; any number of readers. ``SnapshotRef.key`` (a file path,
Redis key or ``s3://`` object) plus ``sha256`` is what a ``PolicyVersion`` claim check needs when
the weights are too big to inline.
"""
