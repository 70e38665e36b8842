from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest
import structlog

from runtime.logging import (
    bind_policy_version,
    bind_role,
    bound_context,
    configure_logging,
    get_logger,
    new_run_id,
)


@pytest.fixture(autouse=True)
def _clean_logging() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_rlstream_handler", False):
            root.removeHandler(h)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_run_id_role_level_timestamp() -> None:
    log = get_logger("rlstream.test")  # created before configuration: must still follow it
    out = io.StringIO()
    configure_logging(role="learner", run_id="run-1", level="info", stream=out)
    log.debug("hidden")
    log.info("step", loss=0.25, blob=object())  # non-JSON values are written with str()
    (rec,) = lines(out)
    assert rec["event"] == "step" and rec["loss"] == 0.25
    assert rec["run_id"] == "run-1" and rec["role"] == "learner"
    assert rec["level"] == "info" and rec["logger"] == "rlstream.test"
    assert rec["timestamp"].endswith("Z")
    assert "object object" in rec["blob"]
    assert "policy_version" not in rec


def test_policy_version_is_updatable_and_removable() -> None:
    out = io.StringIO()
    configure_logging("actor", "r", stream=out)
    log = get_logger()
    bind_policy_version(3)
    log.info("a")
    bind_policy_version(4)
    log.info("b")
    bind_policy_version(None)
    log.info("c")
    recs = lines(out)
    assert [r.get("policy_version") for r in recs] == [3, 4, None]


def test_context_is_per_thread_and_role_overridable() -> None:
    out = io.StringIO()
    configure_logging("colocated", "r", stream=out)
    log = get_logger()
    bind_policy_version(9)

    def actor_thread() -> None:
        bind_role("actor")
        bind_policy_version(7)
        log.info("in_actor")

    t = threading.Thread(target=actor_thread)
    t.start()
    t.join()
    log.info("in_main")
    by_event = {r["event"]: r for r in lines(out)}
    assert by_event["in_actor"]["role"] == "actor" and by_event["in_actor"]["policy_version"] == 7
    assert by_event["in_actor"]["run_id"] == "r"  # process default reaches every thread
    assert by_event["in_main"]["role"] == "colocated" and by_event["in_main"]["policy_version"] == 9


def test_bound_context_restores() -> None:
    out = io.StringIO()
    configure_logging("streams", "r", stream=out)
    log = get_logger()
    with bound_context(batch_id="b1"):
        log.info("inside")
    log.info("outside")
    inside, outside = lines(out)
    assert inside["batch_id"] == "b1" and "batch_id" not in outside


def test_stdlib_records_are_captured() -> None:
    out = io.StringIO()
    configure_logging("streams", "r2", level="warning", stream=out)
    logging.getLogger("faust.worker").info("quiet")
    logging.getLogger("faust.worker").warning("rebalance %d", 3)
    (rec,) = lines(out)
    assert rec["event"] == "rebalance 3" and rec["logger"] == "faust.worker"
    assert rec["role"] == "streams" and rec["run_id"] == "r2" and rec["level"] == "warning"


def test_reconfigure_does_not_stack_handlers() -> None:
    out = io.StringIO()
    configure_logging("a", "r", stream=io.StringIO())
    configure_logging("a", "r", stream=out)
    logging.getLogger("x").warning("once")
    assert len(lines(out)) == 1


def test_exceptions_are_rendered() -> None:
    out = io.StringIO()
    configure_logging("learner", "r", stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger().exception("failed")
    (rec,) = lines(out)
    assert rec["level"] == "error" and "RuntimeError: boom" in rec["exception"]


def test_console_renderer_for_the_cli() -> None:
    out = io.StringIO()
    configure_logging("colocated", "run-c", json=False, stream=out)
    bind_policy_version(2)
    get_logger().info("hello", sps=10)
    text = out.getvalue()
    assert "hello" in text and "policy_version=2" in text and "run_id=run-c" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])
    assert "\x1b[" not in text  # no colours when not a terminal


def test_bad_level_and_run_id() -> None:
    with pytest.raises(ValueError):
        configure_logging("a", "r", level="loud", stream=io.StringIO())
    rid = new_run_id()
    assert len(rid) == 12 and rid != new_run_id()


def test_default_stream_follows_stderr_after_the_one_it_was_made_under_is_closed(monkeypatch) -> None:
    # an in-process command under a test's capture configures logging; the capture then closes
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    configure_logging(role="learner", run_id="r1", json=True)
    get_logger("rlstream.test").info("under_the_first")
    logging.getLogger("thirdparty").warning("stdlib_under_the_first")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    get_logger("rlstream.test").info("under_the_second")  # before: ValueError, I/O on a closed file
    logging.getLogger("thirdparty").warning("stdlib_under_the_second")
    assert [e["event"] for e in lines(second)] == ["under_the_second", "stdlib_under_the_second"]
