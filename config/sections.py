"""The sections of ``TrainConfig`` (``config.train``): one frozen dataclass per part of a run,
rendered by tyro as ``--<section>.<field>`` (``--learner.snapshot-every 3``), but ``run``, whose
flags keep their plain names (``--algo``, ``--env``, ``--total-steps``).

The flat layout of before (one field per flag, ``--snapshot-every``) is mapped here for one
release: ``FLAT`` names the section field of each old field, ``nest`` maps flat keyword
arguments and an old flat run config file, ``rewrite_flat_flags`` maps old flags (with one
deprecation line each on stderr)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, TypeVar

import tyro

from config.limits import DEFAULT_CLAIM_CHECK_ABOVE

_T = TypeVar("_T")
#: A field the entry point sets from its shared flags (``rlstream.cli``), with meanings beyond the
#: field (environment fallbacks, run-directory layout), not a generated flag.
EntryPoint = Annotated[_T, tyro.conf.Suppress]


@dataclass(frozen=True)
class RunSection:
    """What is trained, for how long, and where it goes (flags without a prefix: ``--algo``)."""

    algo: str = "ppo"
    """ppo, grpo, dapo, agro, tba."""
    env_id: Annotated[str, tyro.conf.arg(aliases=("--env", "--env-name"))] = "HalfCheetah-v5"
    """Gymnasium env id (``module:EnvId-v0`` imports the module first)."""
    preset: str = "auto"
    """Per-environment settings over the algorithm's row (``config.algos.ENV_PRESETS``): auto (the
    env's default preset, if the table has one), none, or a preset name (cleanrl, zoo, rlstream). Flags and
    ``--set`` win over it."""
    total_steps: Annotated[int, tyro.conf.arg(aliases=("--total-timesteps",))] = 100_000
    """Environment steps to train for (summed over envs and actors)."""
    seed: int = 0
    """Seed of envs, action noise and the learner."""
    policy_id: str = "policy"
    """The policy this run trains: the learner publishes PolicyVersions under it; actors and
    stream processors follow only its versions (other policies on the same topic are ignored)."""
    resume: bool = False
    """Resume from the newest snapshot (and committed offsets)."""
    plot: bool = True
    """Write <run_dir>/returns.png (return vs steps)."""
    log_every_s: Annotated[float, tyro.conf.arg(aliases=("--log-every",))] = 5.0
    """Seconds between progress lines."""
    wrappers: EntryPoint[tuple[str, ...]] = ()
    """Per-env gymnasium wrappers by name (``actor.envs.WRAPPERS``)."""
    env_kwargs: EntryPoint[dict] = field(default_factory=dict)
    """``gymnasium.make`` keyword arguments of the env (``--env-arg key=value``), over the preset's."""
    algo_overrides: EntryPoint[dict] = field(default_factory=dict)
    """Algorithm config fields to override (from --set key=value)."""
    run_dir: EntryPoint[Path] = Path("runs/latest")
    """Where snapshots, the summary and the plot go."""
    run_id: EntryPoint[str] = ""
    """Bound into logs and events; "": a random id, drawn once when the config is made."""
    tensorboard: EntryPoint[str | None] = None
    """TensorBoard log directory (each role writes its own run under it); None: off."""
    metrics_port: EntryPoint[int | None] = None
    """Prometheus/health port; None: the role default; -1: no server."""


@dataclass(frozen=True)
class ActorSection:
    """The actors: how many, how wide, how they pace themselves against the learner."""

    num_actors: int = 1
    """Actors (co-located: in-process; decoupled: processes)."""
    num_envs: int | None = None
    """Vector env width per actor; None: the algorithm's default (``config.algos.ALGO_DEFAULTS``)."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: train_batch_size // (num_envs * num_actors), or the
    env's episode horizon in group mode (``TrainConfig.effective_fragment_steps``)."""
    group_size: int | None = None
    """Envs per start-state group (GRPO/DAPO; 0: no groups); None: the algorithm's default."""
    overlap: bool = False
    """Co-located only: the actors collect fragment k+1 with policy version v (their envs in child
    processes, ``actor.rollout_process``) while the learner updates on fragment k, so every fragment
    after the first is trained one version after the one that collected it (policy lag 1, reported
    as such). Allowed for the algorithms that correct a lagged behaviour policy
    (``config.algos.ALGO_DEFAULTS``' ``overlap`` column): PPO then trains as decoupled PPO
    (``decoupled=true``: clip anchored at the learner's policy, truncated pi/mu weights); AGRO and
    TBA as they are. Off: strict alternation, lag 0. On two idle cores PPO on HalfCheetah ran 1.31x
    strict PPO's samples/s (docs/benchmarks.md)."""
    actor_steps: int | None = None
    """Decoupled: env steps each actor collects before it stops; None: its share of the budget,
    ceil(total_steps / num_actors)."""
    max_batches_per_version: int | None = None
    """Decoupled, on-policy algorithms: fragments an actor publishes under one policy version
    before it waits for a newer one; None: its share of one learner batch,
    ceil(train_batch_size / (num_actors * num_envs * fragment_steps))."""
    policy_wait_s: float = 20.0
    """Decoupled, on-policy: the most an actor waits for a newer version before it sends one
    more fragment under the old one (a batch lost on the way must not stall training)."""
    actor_lag_versions: int = 0
    """Decoupled only, for staleness experiments: actors act with the newest policy version at least
    this many versions behind the newest they received, so the data is K versions stale through
    the whole pipeline (``bench/staleness.py --decoupled``); 0: the newest, as in production."""
    max_backlog: int = 64
    """Decoupled, off-policy: actors pause while the stream processors' backlog on
    rl.samples.raw (records not yet committed by their group) is above this, and resume at half.
    All algorithms: the end-to-end backlog (that plus the learner's on rl.samples.prepared) above
    which an actor ``max_steps_ahead`` ahead of the learner waits for it."""
    fixed_fragments: bool = False
    """Decoupled, off-policy, no ``fragment_steps`` given: keep the fragment length fixed instead of
    following that backlog (``actor.fragment_size.FragmentSizeController``, 32..256 steps per env)."""
    max_steps_ahead: int | None = None
    """Decoupled: env steps an actor may publish since the policy version last advanced before it
    waits for the learner, while the end-to-end backlog is above ``max_backlog``
    (``actor.flow.LearnerGate``); None: 4 x the larger of one learner batch and one fragment of
    the actor (``TrainConfig.steps_ahead_bound``)."""


@dataclass(frozen=True)
class LearnerSection:
    """The learner: its batch, devices and ranks, snapshots and breakers."""

    train_batch_size: int | None = None
    """Transitions per learner update; None: the algorithm's default."""
    device: str = "cpu"
    """torch device of the learner: cpu, cuda, cuda:1, or one per rank, cuda:0,1,2,3."""
    learners: int | None = None
    """Data-parallel learner ranks (docs/explanation/learner-ranks.md); None: one per device of ``device``."""
    compile_update: bool | None = None
    """Capture each minibatch step (forward, loss, backward, Adam) with torch.compile
    (``agents.capture``). None: auto, on where it pays (``agents.capture.pays_to_capture``: PPO or
    AGRO on one rank, in a run of twice the optimizer steps its compile takes to pay back, e.g.
    CleanRL's 1M-step PPO; docs/benchmarks.md). False: eager; True: always (any algorithm)."""
    grad_compression: str = "none"
    """Gradient all-reduce between ranks: none, fp16 or bf16 (torch's DDP compress hooks)."""
    dynamic_batch: bool = False
    """The learner's minibatch size follows the accelerator's load, 32..256 transitions
    (``learner.minibatch``: GPU utilisation, or the learner's duty cycle without a GPU)."""
    snapshot_store: str | None = None
    """Snapshot store: a path, ``redis://...`` or ``s3://bucket/prefix`` (endpoint and credentials
    from ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...; ``pip install 'rlstream[s3]'``); None:
    <run_dir>/snapshots."""
    snapshot_every: int = 10
    """Updates between snapshots (the store keeps the newest 10, ``?keep_last=N`` in its URL)."""
    snapshot_interval_s: float = 86_400.0
    """Seconds between time-based snapshots (daily by default), taken at the first update after
    the interval ran out since the store's newest one; kept by their own retention; 0: off."""
    snapshot_keep_timed: int = 7
    """Time-based snapshots kept, apart from the newest 10 (``?keep_timed=N`` in the URL wins)."""
    breaker_open_above: float = 256.0
    """Circuit breaker: pause training when the stream processors' backlog on rl.samples.raw
    (records) passes this; the learner would otherwise keep versioning ahead of stale data."""
    breaker_close_below: float = 32.0
    """Circuit breaker: resume once the backlog is back under this."""
    breaker_policy_lag_versions: int | None = None
    """Circuit breaker on policy lag (both modes): hold learner updates while the newest data it
    reads was collected more than this many versions behind its policy, and resume once that
    lag is under half of it; None: the staleness window K of the run's stream processors (data
    past it is dropped or down-weighted anyway, so training further ahead only wastes the
    actors' work), off under ``actor.actor_lag_versions`` (stale on purpose); 0: off."""
    on_fenced: Literal["exit", "wait"] = "exit"
    """What a learner does once a newer learner of its run and rank has fenced it (Kafka;
    either way it writes nothing more, no snapshot either): ``exit`` with status 4
    (``EXIT_FENCED``, which the local supervisor does not restart), or ``wait`` for SIGTERM
    or SIGINT, then exit 4, alive (``/healthz``) but not ready (``/readyz``: fenced), so
    that an orchestrator which restarts every exit (Kubernetes, docker compose) does not
    restart it into fencing the newer one in turn (docs/deploy.md)."""


@dataclass(frozen=True)
class ReplaySection:
    """The learner's sample cache (``learner.replay.ReplayConfig``, off-policy algorithms only)."""

    enabled: bool = False
    """Off-policy algorithms (agro, tba): the learner also trains on fragments replayed from a
    cache of the last ``capacity`` transitions it trained on (``learner.replay``)."""
    capacity: int = 1000
    """Transitions the learner node's sample cache holds (whole fragments; a fragment must fit)."""
    samples_per_insert: float = 2.0
    """Rate limiter: trainings per transition inserted, its fresh one included (Reverb's SPI)."""
    max_reuse: int = 2
    """Times one cached fragment may be replayed."""
    min_size: int = 0
    """Transitions cached before any replay; 0: half the capacity."""

    def settings(self) -> dict[str, Any]:
        """The ``learner.replay.ReplayConfig`` fields of this section."""
        return {"capacity": self.capacity, "samples_per_insert": self.samples_per_insert,
                "max_reuse": self.max_reuse, "min_size": self.min_size}


@dataclass(frozen=True)
class DeploySection:
    """How the run's processes are run and what they share: threads, decoupled supervision,
    Redis claim checks and the host blob cache."""

    torch_threads: int | None = None
    """Intra-op threads of torch in this process; None: 1, in both modes. The policies are small
    MLPs: on an idle 2-core machine co-located PPO on HalfCheetah ran as fast with one thread as
    with two (wall 0.99x, CPU 0.68x), and beside one other busy process torch's default of two
    threads ran it at 60 samples/s against 2,142 with one (their spin-waits). Raise it for a
    large model on a machine of its own."""
    stream_workers: int = 1
    """Decoupled: Faust workers ``rlstream train --mode decoupled`` starts in the streams group
    (they split the partitions of rl.samples.raw, ``--partitions``)."""
    max_restarts: int = 3
    """Decoupled: restarts of one role after it dies or fails its liveness probe (backoff 1 s,
    doubling to 30 s) before the run fails naming its log file."""
    liveness_probes: bool = True
    """Decoupled: probe each child's ``/healthz`` as the manifests' ``livenessProbe`` does (every
    10 s, 3 s timeout: ``runtime.ports.LIVENESS_PROBE``), once it has answered once, and kill
    and restart one that fails 3 probes in a row (a hung or slow process)."""
    redis_url: str | None = None
    """Redis for claim-check weights (None: inline only)."""
    claim_check_above: int = DEFAULT_CLAIM_CHECK_ABOVE
    """With Redis: weights over this many bytes go by claim check (a tiny record fans out to
    the actors; each host fetches the blob once)."""
    blob_cache: str | None = None
    """Directory of the host's one verified copy of each claim-checked blob, shared by its
    processes (streams/blobcache.py); ``off``: each process fetches its own; None (and no
    ``RLSTREAM_BLOB_CACHE`` at the entry point): /dev/shm/rlstream-blobs-<uid>."""


#: The sections of ``TrainConfig`` by field name, and whether tyro prefixes their flags.
SECTIONS: dict[str, type] = {"run": RunSection, "actor": ActorSection, "learner": LearnerSection,
                             "replay": ReplaySection, "deploy": DeploySection}
UNPREFIXED = ("run",)

#: Section fields added after the flat layout: they have no flat name.
SECTION_ONLY = ("env_kwargs", "on_fenced")
#: The old flat ``TrainConfig`` field -> (its section, its field there).
FLAT: dict[str, tuple[str, str]] = {
    f.name: (section, f.name) for section, cls in SECTIONS.items() if section != "replay" for f in fields(cls)
    if f.name not in SECTION_ONLY}
FLAT.update({"replay": ("replay", "enabled"), **{f"replay_{f.name}": ("replay", f.name)
                                                 for f in fields(ReplaySection) if f.name != "enabled"}})


def field_of(section: str, name: str):
    return next(f for f in fields(SECTIONS[section]) if f.name == name)


def flag_of(section: str, name: str) -> str:
    """The flag of a section field as tyro renders it: ``--learner.snapshot-every``, ``--algo``."""
    dashed = name.replace("_", "-")
    return f"--{dashed}" if section in UNPREFIXED else f"--{section}.{dashed}"


def flat_flag_of(flat: str) -> str:
    """The flag of a section field from its old flat field name (``num_envs`` -> ``--actor.num-envs``)."""
    return flag_of(*FLAT[flat])


def nest(flat: dict[str, Any], given: dict[str, Any] | None = None) -> dict[str, Any]:
    """``TrainConfig`` keyword arguments of ``given`` (sections and top-level fields) with the old
    flat fields of ``flat`` put in their sections (over the section ``given`` holds, if any)."""
    from dataclasses import replace

    out = dict(given or {})
    per: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        section, attr = FLAT[name]
        per.setdefault(section, {})[attr] = value
    for section, values in per.items():
        base = out.get(section)
        out[section] = replace(base, **values) if base is not None else SECTIONS[section](**values)
    return out


def _old_flags() -> dict[str, str]:
    """Each deprecated flat flag -> the flag it now is (bools with their ``--no-`` form too)."""
    out: dict[str, str] = {}
    for flat, (section, attr) in FLAT.items():
        if section in UNPREFIXED:
            continue
        new = flag_of(section, attr)
        out[f"--{flat.replace('_', '-')}"] = new
        if field_of(section, attr).type in ("bool", bool):
            out[f"--no-{flat.replace('_', '-')}"] = f"--{section}.no-{attr.replace('_', '-')}"
    out["--policy-wait"] = flag_of("actor", "policy_wait_s")  # old aliases
    return out


#: Every deprecated flat flag -> its new spelling (``--snapshot-every`` -> ``--learner.snapshot-every``).
OLD_FLAGS: dict[str, str] = _old_flags()


def rewrite_flat_flags(argv: list[str], warn: Callable[[str], None] | None = None) -> list[str]:
    """``argv`` with each deprecated flat flag (``--num-envs 4``, ``--num-envs=4``) spelled as its
    section flag; ``warn`` gets one line for each (default: stderr). The flat flags go in the
    release after the one that deprecated them."""
    out = []
    for tok in argv:
        name, eq, value = tok.partition("=")
        new = OLD_FLAGS.get(name)
        if new is None:
            out.append(tok)
            continue
        line = f"warning: {name} is deprecated (flat flags go in the next release); use {new}"
        if warn is None:
            print(line, file=sys.stderr, flush=True)
        else:
            warn(line)
        out.append(f"{new}{eq}{value}")
    return out
