"""Two of three brokers down while the controller quorum lives: below ``min.insync.replicas``, the
producers get NOT_ENOUGH_REPLICAS and the actor backs off; nothing acknowledged is lost, and once
one broker returns the run finishes with the ledger whole (issue 39, part 3).

The cluster is ``rlstream broker start --nodes 3 --controllers 1``: three broker-only nodes and a
controller-only one, the KRaft quorum's only voter. Killing two brokers leaves the quorum whole,
so the controller fences them and shrinks every ISR to the surviving broker (unlike
``test_cluster_faults.py``'s combined nodes, where two nodes down is also the quorum lost and the
producers see only timeouts). The surviving leader then refuses ``acks=all`` writes of a topic
with ``min.insync.replicas`` 2 with NOT_ENOUGH_REPLICAS, which librdkafka retries by itself.

Asserted, beside ``test_cluster_faults.decoupled_run_through``'s ledger (acknowledged = in the
samples topic = trained once, every role exits 0): the actor's own process counted the broker's
NOT_ENOUGH_REPLICAS (``rlstream_produce_errors_total{code}`` on its ``/metrics``, from the
producer's reports, while the brokers are down); ``HOLD_S`` after the first refusal the actor has
stepped at most one fragment past the kill, with that one unacknowledged
(``rlstream_unacknowledged_batches``), and the samples topic gained at most that one record; and
its back-off is counted (``rlstream_actor_backoffs_total`` and ``_seconds_total``, and its summary's
``backoff``)."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from streams.topics import SAMPLES_RAW
from tests.support import free_ports

from .conftest import FRAGMENT, TopicCounter, wait_for
from .test_cluster_faults import (  # noqa: F401  (healthy, run: fixtures on this module's cluster)
    CODEC,
    STARTUP_S,
    cli_cluster,
    decoupled_run_through,
    healthy,
    run,
    start_node,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
NER = ("NOT_ENOUGH_REPLICAS", "NOT_ENOUGH_REPLICAS_AFTER_APPEND")
#: How long the brokers stay down once the actor is refused: past the on-policy actor's own wait
#: for a newer version (``OnPolicySync.max_wait_s``, 20 s), after which an actor that did not wait
#: for its acknowledgements would publish another fragment.
HOLD_S = 25.0
_SAMPLE = re.compile(r'^(rlstream_\w+?)(?:\{(.*)\})? ([-+\de.naif]+)$', re.M)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three brokers and one dedicated controller, started with the CLI; SIGKILLed at the end."""
    with cli_cluster(tmp_path_factory, controllers=1) as c:
        assert (c.broker_ids, c.controller_ids) == ([1, 2, 3], [4])
        yield c


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(family sample name, labels text) -> value from a role's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(m[1], m[2] or ""): float(m[3]) for m in _SAMPLE.finditer(text)}


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` (0 when there is none)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for (n, lab), v in samples.items() if n == name and all(w in lab for w in want))


def test_two_of_three_brokers_down_below_min_insync_with_the_quorum_kept(healthy, run):
    rig, ns = run
    topic = ns.topic(SAMPLES_RAW)
    raw = TopicCounter(rig.bootstrap, topic, CODEC.decode)
    port = free_ports(1)[0]

    def below_min_insync(steps, updates, actor) -> dict:
        keep = healthy.leader(topic, 0)
        first, second = [n for n in healthy.broker_ids if n != keep]
        controller = healthy.controller()
        before = steps.poll()
        raw.poll()
        at_kill = scrape(port)
        killed = time.monotonic()
        healthy.kill(first)
        healthy.kill(second)

        def refused() -> dict | None:  # the broker's error, as the actor's own process counted it
            assert actor.alive(), rig.logs()
            now = scrape(port)
            return now if sum(metric(now, "rlstream_produce_errors_total", code=c) for c in NER) else None

        seen = wait_for(refused, 150, "the actor to count NOT_ENOUGH_REPLICAS", every=0.5, ignore=(OSError,),
                        on_timeout=rig.logs)
        refused_at = time.monotonic()
        refused_s = round(refused_at - killed, 1)
        # backing off: still refused HOLD_S later, no step past the one fragment of the kill's round,
        # that fragment unacknowledged
        first_count = sum(metric(seen, "rlstream_produce_errors_total", code=c) for c in NER)

        def still_refused() -> dict | None:
            now = refused()
            return now if (now and time.monotonic() >= refused_at + HOLD_S and sum(
                metric(now, "rlstream_produce_errors_total", code=c) for c in NER) >= first_count + 3) else None

        later = wait_for(still_refused, HOLD_S + 60, f"{HOLD_S:g}s more of NOT_ENOUGH_REPLICAS retries", every=0.5,
                         ignore=(OSError,), on_timeout=rig.logs)
        stepped = (metric(later, "rlstream_samples_total", stage="actor")
                   - metric(at_kill, "rlstream_samples_total", stage="actor"))
        unacknowledged = metric(later, "rlstream_unacknowledged_batches")
        raw_before = len(raw.items)
        raw.poll()
        down = {"updates": steps.poll() - before, "raw_records": len(raw.items) - raw_before,
                "actor_samples_stepped": stepped, "actor_unacknowledged": unacknowledged,
                "not_enough_replicas": {c: metric(later, "rlstream_produce_errors_total", code=c) for c in NER}}
        assert stepped <= FRAGMENT, f"the actor stepped {stepped} samples past the kill: it did not back off"
        assert unacknowledged == 1, f"{unacknowledged} batches unacknowledged while refused"
        # at most the batch appended before the ISR shrank (it waits for its acknowledgement)
        assert down["raw_records"] <= 1, down
        start_node(healthy, first)  # two brokers of three: 2 in-sync copies again
        wait_for(updates(before + 2), 240, "training with two brokers of three", every=0.2, on_timeout=rig.logs)
        recovered_s = round(time.monotonic() - killed, 1)
        start_node(healthy, second)
        healthy.wait_in_sync(STARTUP_S)
        after = scrape(port)
        return {"fault": f"SIGKILL of brokers {first} and {second} (2 of 3: below min.insync.replicas), broker "
                         f"{keep} (leader of {topic}[0]) and controller {controller} kept; broker {first} "
                         f"restarted once the actor was refused, then broker {second}",
                "kill_to_not_enough_replicas_s": refused_s, "while_two_down": down,
                "kill_to_two_updates_s": recovered_s, "updates_during_fault": steps.poll() - before,
                "actor_metrics": {"backoffs": metric(after, "rlstream_actor_backoffs_total"),
                                  "backoff_s": round(metric(after, "rlstream_actor_backoff_seconds_total"), 1),
                                  **{c: metric(after, "rlstream_produce_errors_total", code=c) for c in NER}}}

    try:
        ledger = decoupled_run_through(healthy, rig, ns, "below-min-insync", below_min_insync,
                                       actor_args=("--metrics-port", str(port)))
    finally:
        raw.close()
    m = ledger["actor_metrics"]
    assert m["backoffs"] >= 1 and m["backoff_s"] >= 5, m  # the wait through the refusals was counted
    assert ledger["actor_backoff"]["waits"] == m["backoffs"], ledger["actor_backoff"]
    assert ledger["actor_produce_errors"].get(NER[0], 0) >= 1, ledger["actor_produce_errors"]
