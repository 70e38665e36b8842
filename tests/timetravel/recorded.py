"""A short recorded co-located PPO run (4 updates on InvertedPendulum-v5), shared by the module's
tests, and a way to tamper with one record of a run's log the way a person would: one byte of
a PreparedBatch payload changed, the frame's CRC recomputed so the log still opens."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rlstream.colocated import run_colocated
from config import BusConfig, TrainConfig
from schemas.codec import Codec
from schemas.events import PreparedBatch
from streams.bus.filelog import encode_frame, read_partition
from streams.topics import SAMPLES_PREPARED

ENV_ID = "InvertedPendulum-v5"
UPDATES = 4
BATCH = 256
# small updates keep the test quick; the replay runs exactly the same ones
OVERRIDES = {"update_epochs": 2, "num_minibatches": 4}


def record_run(run_dir: Path, run_id: str) -> dict:
    torch.set_num_threads(1)
    cfg = TrainConfig(env_id=ENV_ID, total_steps=UPDATES * BATCH, train_batch_size=BATCH, seed=5,
                      run_dir=run_dir, run_id=run_id, log_every_s=1e9, algo_overrides=dict(OVERRIDES),
                      bus=BusConfig(log_dir=str(run_dir / "log")))
    return run_colocated(cfg)


def copy_run(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


def tamper_prepared(run_dir: Path, index: int) -> str:
    """Flip the lowest bit of one observation float in the ``index``-th PreparedBatch record of
    the run's log (rewriting the partition file with valid frames); returns its batch id."""
    path = run_dir / "log" / SAMPLES_PREPARED / "0.log"
    records = list(read_partition(path, SAMPLES_PREPARED, 0))
    rec = records[index]
    pb = Codec().decode(rec.value, PreparedBatch)
    needle = np.ascontiguousarray(pb.sample.obs).tobytes()[:16]
    at = rec.value.find(needle)
    assert at > 0, "observation bytes not found in the record"
    value = bytearray(rec.value)
    value[at] ^= 0x01  # least significant mantissa bit of obs[0, 0, 0] (little-endian float32)
    records[index] = replace(rec, value=bytes(value))
    path.write_bytes(b"".join(encode_frame(r) for r in records))
    return pb.sample.batch_id
