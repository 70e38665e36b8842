"""The data half of each algorithm's spec: its row of defaults (data collection, batching, the
stream processors' staleness and importance settings) and its ``--actor.overlap`` correction. Pure
data, so the CLI and ``config.TrainConfig`` read it without torch; ``agents.registry.SPECS``
binds each row to its config and algorithm classes and its replay rule (a new algorithm: a row
here, a spec there). Read by ``agents.base`` (``is_on_policy``), ``config.PrepareConfig.for_algo``
and ``config.TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["AlgoDefaults", "ALGO_DEFAULTS", "TRAINABLE", "algo_defaults", "EnvPreset", "ENV_PRESETS",
           "PRESET_CHOICES", "TASK_ENV_KWARGS", "env_family", "env_kwargs_of", "env_preset"]


@dataclass(frozen=True)
class AlgoDefaults:
    """One algorithm's row: what ``rlstream train --algo X`` uses when no flag says otherwise."""

    on_policy: bool
    """The algorithm assumes (near-)fresh data: decoupled actors wait for new versions."""
    num_envs: int
    """Vector env width per actor."""
    group_size: int
    """Envs per start-state group (0: no groups). Group mode makes each column one rollout."""
    train_batch_size: int
    """Transitions per learner update."""
    max_versions: int
    """Staleness window K: most policy versions a batch may lag the latest."""
    max_ms: int | None
    """Staleness window T in ms (None: no time limit)."""
    staleness_mode: Literal["drop", "downweight"] = "drop"
    """Stale batches are dropped, or kept at a lower weight."""
    min_weight: float = 0.05
    """Downweight mode: batches whose weight falls below this are dropped."""
    importance: bool = True
    """The stream processors compute V-trace IS weights against the latest policy."""
    online: bool = True
    """Trained from live rollouts (a ``rlstream train --algo`` choice); DPO trains on replayed data."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: ``train_batch_size // (num_envs * num_actors)``, or in
    group mode the env's episode horizon (``max_episode_steps``)."""
    overlap: dict[str, Any] | None = None
    """Co-located ``--actor.overlap`` (actors collect the next fragment while the learner updates, so
    each fragment is trained one version after the one that collected it): the algorithm fields
    that correct for that lag, set by the option; None: the algorithm has no correction for a
    lagged behaviour policy, and the option is refused."""
    capture_break_even_steps: int | None = None
    """Optimizer steps after which the captured update (``agents.capture``) has paid for its
    compile on CPU: compile seconds over seconds saved per step, measured by ``bench/update.py
    --compare`` at 2,048 samples on a loaded 2-core machine (docs/benchmarks.md). None: not
    measured to gain, so the auto rule leaves the update eager."""

    def prepare(self) -> dict[str, Any]:
        """The ``PrepareConfig`` fields of this row."""
        return {"max_versions": self.max_versions, "max_ms": self.max_ms, "staleness_mode": self.staleness_mode,
                "min_weight": self.min_weight, "importance": self.importance}


#: PPO, AGRO and TBA bootstrap a learned value, so fragments may cut episodes anywhere: CleanRL's
#: 1 env x 2048 steps. GRPO and DAPO compare whole rollouts from one start state: one group of 8
#: rollouts per fragment, fragments as long as an episode (ended early once all 8 are done), and
#: a small batch, counted in padded steps: 512 is a few groups while rollouts are short and one
#: group per update once they pass 64 steps (InvertedPendulum, 30k steps, 3 seeds: GRPO reached
#: a return of ~290 with 512 vs ~170 with 1024; 8 rollouts per group beat 2 groups of 4).
#: Staleness windows are starting points, not tuned: on-policy methods drop stale data early,
#: off-policy-tolerant ones keep it at a lower weight; DPO learns from replayed preferences (the
#: reference, not the version, anchors its loss), so nothing is ever stale for it.
#: ``overlap``: PPO trains a one-version-stale fragment as decoupled PPO (clip anchored at the
#: learner's policy, V-trace's truncated pi/mu weights); AGRO and TBA correct stale data as they
#: are; GRPO and DAPO clip around the behaviour policy with no correction for a lagged one.
ALGO_DEFAULTS: dict[str, AlgoDefaults] = {
    "ppo": AlgoDefaults(on_policy=True, num_envs=1, group_size=0, train_batch_size=2048,
                        max_versions=4, max_ms=60_000, overlap={"decoupled": True},
                        capture_break_even_steps=12_500),  # 35 s compile / 2.8 ms saved a step
    "grpo": AlgoDefaults(on_policy=True, num_envs=8, group_size=8, train_batch_size=512,
                         max_versions=1, max_ms=60_000),
    "dapo": AlgoDefaults(on_policy=True, num_envs=8, group_size=8, train_batch_size=512,
                         max_versions=1, max_ms=60_000),
    "agro": AlgoDefaults(on_policy=False, num_envs=1, group_size=0, train_batch_size=2048,
                         max_versions=4, max_ms=120_000, staleness_mode="downweight", overlap={},
                         capture_break_even_steps=25_000),  # 24 s / 1.0 ms
    "tba": AlgoDefaults(on_policy=False, num_envs=1, group_size=0, train_batch_size=2048,
                        max_versions=16, max_ms=300_000, staleness_mode="downweight", min_weight=0.01,
                        overlap={}),
    "dpo": AlgoDefaults(on_policy=False, num_envs=1, group_size=0, train_batch_size=2048,
                        max_versions=1 << 30, max_ms=None, importance=False, online=False),
}

#: The ``rlstream train --algo`` choices.
TRAINABLE: tuple[str, ...] = tuple(name for name, row in ALGO_DEFAULTS.items() if row.online)


def algo_defaults(algo: str) -> AlgoDefaults:
    """The row of ``algo`` (case-insensitive); unknown names raise ``ValueError``."""
    try:
        return ALGO_DEFAULTS[algo.lower()]
    except KeyError:
        raise ValueError(f"unknown algorithm {algo!r}; choose from {sorted(ALGO_DEFAULTS)}") from None


@dataclass(frozen=True)
class EnvPreset:
    """Per-environment settings of one algorithm, over its row: the RL Baselines3 Zoo approach
    (observation/reward normalisation, learning rate, batch, epochs per task)."""

    source: str
    """Where the values come from (a published, versioned hyperparameter file)."""
    train_batch_size: int | None = None
    """Transitions per learner update (the zoo's ``n_steps * n_envs``)."""
    algo: dict[str, Any] = field(default_factory=dict)
    """Algorithm config fields (what ``--set key=value`` overrides)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """``gymnasium.make`` keyword arguments of the task (what ``--env-arg key=value`` overrides)."""


#: SB3's PPO on MuJoCo, from DLR-RM/rl-baselines3-zoo hyperparams/ppo.yml (commit 00128b5, the
#: tuned "-v3" rows; the tasks are the same in v5). Translated: ``n_steps`` -> train_batch_size
#: (one env); ``batch_size`` -> num_minibatches = n_steps / batch_size; ``n_epochs`` ->
#: update_epochs; ``clip_range`` -> clip_coef; a constant learning rate -> anneal_lr=False; SB3
#: leaves the value loss unclipped (clip_vloss=False); ``policy_kwargs`` -> init_log_std, ReLU,
#: 256x256 (SB3 also turns orthogonal init off: rlstream always uses it). ``normalize: true`` is
#: rlstream's default (running observation and return normalisation).
_ZOO = "rl-baselines3-zoo hyperparams/ppo.yml @00128b5"
_ZOO_NET = {"hidden": (256, 256), "activation": "relu", "init_log_std": -2.0, "anneal_lr": False,
            "clip_vloss": False}


def _zoo(n_steps: int, batch: int, **algo: Any) -> EnvPreset:
    return EnvPreset(_ZOO, train_batch_size=n_steps, algo={"num_minibatches": n_steps // batch, **algo})


#: The algorithm's own row as a named preset: CleanRL's ppo_continuous_action.py settings.
_CLEANRL = EnvPreset("CleanRL ppo_continuous_action.py (the ppo row)")

#: ``(algo, env family) -> {preset name: EnvPreset}``; the first name is the default, used when
#: no ``--preset`` is given, chosen by measured return at 1M steps (bench/mujoco_table.py,
#: docs/algorithms.md). HalfCheetah defaults to the zoo row: 3 seeds at 1M steps evaluated at
#: about three times CleanRL's settings (5.6k against 1.8k), and it passes their 1M figure by
#: 100k steps. "cleanrl", the algorithm's own row, is the default on the other four: Hopper (the zoo
#: row settled in the stand-still optimum, ~1,000, on seed 0; CleanRL's settings reached ~3,400),
#: Walker2d, Ant and Humanoid (the zoo row measured lower). The other rows stay as ``--preset``.
ENV_PRESETS: dict[tuple[str, str], dict[str, EnvPreset]] = {
    ("ppo", "HalfCheetah"): {
        "zoo": _zoo(512, 64, gamma=0.98, learning_rate=2.0633e-05, ent_coef=0.000401762, clip_coef=0.1,
                    update_epochs=20, gae_lambda=0.92, max_grad_norm=0.8, vf_coef=0.58096, **_ZOO_NET),
        "cleanrl": _CLEANRL,
    },
    ("ppo", "Hopper"): {
        "cleanrl": _CLEANRL,
        "zoo": _zoo(512, 32, gamma=0.999, learning_rate=9.80828e-05, ent_coef=0.00229519, clip_coef=0.2,
                    update_epochs=5, gae_lambda=0.99, max_grad_norm=0.7, vf_coef=0.835671, **_ZOO_NET),
    },
    # Walker2d: 3 seeds each at 1M steps, CleanRL's settings 4,791 +- 880 eval (4,234 +- 990 train)
    # against the zoo row's 4,002 +- 188 (3,265 +- 373) at 2.1x the wall time.
    ("ppo", "Walker2d"): {
        "cleanrl": _CLEANRL,
        "zoo": _zoo(512, 32, gamma=0.99, learning_rate=5.05041e-05, ent_coef=0.000585045, clip_coef=0.1,
                    update_epochs=20, gae_lambda=0.95, max_grad_norm=1.0, vf_coef=0.871923, anneal_lr=False,
                    clip_vloss=False),
    },
    # Humanoid: the zoo row reached 546 +- 61 eval (489 +- 4 train) on seeds 0-1 at 1M steps,
    # CleanRL's settings 694 +- 58 (670 +- 29) on seeds 0-2.
    ("ppo", "Humanoid"): {
        "cleanrl": _CLEANRL,
        "zoo": _zoo(512, 256, gamma=0.95, learning_rate=3.56987e-05, ent_coef=0.00238306, clip_coef=0.3,
                    update_epochs=5, gae_lambda=0.9, max_grad_norm=2.0, vf_coef=0.431892, **_ZOO_NET),
    },
    # The zoo's Ant row is SB3's PPO defaults with normalisation: CleanRL's settings but for a
    # constant learning rate and no value clipping. With v5's contact forces observed it trained
    # to ~210 at 1M steps on seed 0, below CleanRL's settings: Ant defaults to "cleanrl".
    ("ppo", "Ant"): {
        "cleanrl": _CLEANRL,
        "zoo": _zoo(2048, 64, anneal_lr=False, clip_vloss=False),
    },
    # AGRO's own row (4 epochs of 8 minibatches, lambda 1, beta 1) moves the policy a fifth as far
    # per update as PPO (KL to the collecting policy ~0.002 against ~0.011): Ant does not learn in 1M
    # steps (eval 37). PPO's update count and lambda with beta 1 overshoot: the squared log-ratio
    # term lets each update go further as the action std shrinks (KL per update 0.013 at the start,
    # 0.10 by 300k steps, where PPO's clip holds ~0.011): eval 15 at 1M. beta 2 slows that growth:
    # eval 681 (train 503) on seed 0 at 1M; beta 5 was as slow as the own row (docs/algorithms.md).
    ("agro", "Ant"): {
        "rlstream": EnvPreset("measured here on Ant-v5 at 1M steps (docs/algorithms.md)",
                              algo={"update_epochs": 10, "num_minibatches": 32, "gae_lambda": 0.95, "beta": 2.0}),
    },
}

#: ``gymnasium.make`` keyword arguments of a task family, for every algorithm unless ``--preset
#: none``; a preset's own ``env_kwargs`` and ``--env-arg`` win over them. Ant: both references
#: observed no contact forces (v4 leaves them out by default; v3's were all zeros under
#: mujoco-py 2), where v5 adds 78 of them to the body's 27 values. Without them PPO at CleanRL's
#: settings evaluated at 3,216 +- 454 on seeds 0-1 at 1M steps (train 2,086), with them at
#: 700 +- 69 (train 514; docs/algorithms.md). The reward is v5's either way.
TASK_ENV_KWARGS: dict[str, dict[str, Any]] = {
    "Ant": {"include_cfrc_ext_in_observation": False},
}

#: ``--preset`` values: ``auto`` (the env's default preset, else none), ``none`` (the algorithm's
#: row only), or a preset name.
PRESET_CHOICES: tuple[str, ...] = ("auto", "none", "cleanrl", "zoo", "rlstream")


def env_family(env_id: str) -> str:
    """``HalfCheetah`` of ``HalfCheetah-v5`` or ``pkg.mod:HalfCheetah-v5``."""
    name = env_id.rpartition(":")[2]
    base, dash, version = name.rpartition("-")
    return base if dash and version[:1] == "v" and version[1:].isdigit() else name


def env_kwargs_of(algo: str, env_id: str, preset: str = "auto") -> dict[str, Any]:
    """The ``gymnasium.make`` keyword arguments the table gives ``algo`` on ``env_id``: the task's
    (``TASK_ENV_KWARGS``), then the preset's; none with ``preset="none"``."""
    if preset == "none":
        return {}
    found = env_preset(algo, env_id, preset)
    return {**TASK_ENV_KWARGS.get(env_family(env_id), {}), **(found[1].env_kwargs if found else {})}


def env_preset(algo: str, env_id: str, preset: str = "auto") -> tuple[str, EnvPreset] | None:
    """The preset of ``algo`` on ``env_id``: ``(name, EnvPreset)``, or None (``none``, or no row);
    ``ValueError`` for a name the table does not hold for this pair."""
    if preset == "none":
        return None
    rows = ENV_PRESETS.get((algo.lower(), env_family(env_id)), {})
    if preset == "auto":
        return next(iter(rows.items()), None)
    if preset not in rows:
        have = ", ".join(["auto", "none", *rows])
        raise ValueError(f"no preset {preset!r} for {algo} on {env_family(env_id)}; choose from {have}")
    return preset, rows[preset]
