"""The in-memory bus with files: history and commits survive a restart; damage is handled."""

from __future__ import annotations

import pytest

from streams.bus.filelog import LogCorruptError
from streams.bus.memory import MemoryBus
from streams.topics import TopicSpec


def fill(path, n=10, partitions=2):
    bus = MemoryBus(path=path)
    bus.create_topics([TopicSpec("t", key="k", partitions=partitions)])
    for i in range(n):
        bus.produce("t", b"v%d" % i, key=b"k%d" % (i % 3), headers={"h": b"%d" % i})
    c = bus.consumer("g", ["t"])
    got = c.poll(0, max_records=4)
    c.commit(got)
    bus.close()
    return got


def test_restart_keeps_records_offsets_headers_and_commits(tmp_path):
    committed = fill(tmp_path)
    bus = MemoryBus(path=tmp_path)
    assert sum(bus.end_offsets("t").values()) == 10
    every = list(bus.read_all("t"))
    assert sorted(r.value for r in every) == sorted(b"v%d" % i for i in range(10))
    assert all(r.headers["h"] == r.value[1:] for r in every)
    # the group resumes after its commit: exactly the 6 it had not committed
    c = bus.consumer("g", ["t"])
    rest = c.poll(0, max_records=100)
    assert len(rest) == 6
    assert not {(r.partition, r.offset) for r in rest} & {(r.partition, r.offset) for r in committed}
    # and new records continue the offsets
    bus.produce("t", b"new", key=b"k0")
    assert sum(bus.end_offsets("t").values()) == 11


def test_a_torn_last_record_is_cut_off(tmp_path):
    fill(tmp_path, n=3, partitions=1)
    f = tmp_path / "t" / "0.log"
    data = f.read_bytes()
    f.write_bytes(data[:-5])  # crash in the middle of the last write
    bus = MemoryBus(path=tmp_path)
    assert bus.end_offsets("t") == {0: 2}
    assert f.stat().st_size < len(data) - 5  # the torn frame is gone from the file too
    bus.produce("t", b"after", key=b"x")
    bus.close()
    assert [r.value for r in MemoryBus(path=tmp_path).read_all("t")] == [b"v0", b"v1", b"after"]


def test_corruption_before_the_end_refuses_to_open(tmp_path):
    fill(tmp_path, n=3, partitions=1)
    f = tmp_path / "t" / "0.log"
    data = bytearray(f.read_bytes())
    data[20] ^= 0xFF  # inside the first record's body
    f.write_bytes(bytes(data))
    with pytest.raises(LogCorruptError, match="CRC mismatch"):
        MemoryBus(path=tmp_path)
