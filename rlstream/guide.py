"""The deployment guide's spellings of ``rlstream train`` and the checks that a run can start here.

``--strategy on-policy`` is co-located mode with an on-policy algorithm (PPO unless ``--algo``
names another), ``--strategy off-policy`` decoupled mode with an off-policy one (AGRO unless
``--algo`` says); ``--importance-sampling`` is ``--importance``; ``--env-name`` is ``--env``;
``--learner.device cuda:0,1,2,3`` is four learner ranks. What cannot run here (an env version that no
longer loads, a CUDA device this machine does not have) is refused before anything is created,
in one line that ends with the exact command that does the same here."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from config.algos import ALGO_DEFAULTS, TRAINABLE

#: ``--strategy`` -> (mode, the algorithms of that family, the one trained when ``--algo`` is not given).
STRATEGIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "on-policy": ("colocated", tuple(a for a in TRAINABLE if ALGO_DEFAULTS[a].on_policy), "ppo"),
    "off-policy": ("decoupled", tuple(a for a in TRAINABLE if not ALGO_DEFAULTS[a].on_policy), "agro"),
}
#: Every spelling of the env flag (``TrainConfig.env_id``'s flag and its aliases).
ENV_FLAGS = ("--env-id", "--env", "--env-name")


def given(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last flag of ``argv`` spelled as one of ``names`` (``--f v`` or ``--f=v``)."""
    value = None
    for i, tok in enumerate(argv):
        name, eq, rest = tok.partition("=")
        if name in names:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def with_flag(argv: Sequence[str], names: Sequence[str], value: str | None) -> list[str]:
    """``argv`` with the flag spelled as one of ``names`` set to ``value`` where it stands (the
    user's spelling kept), or appended as ``names[0]``; ``value`` None removes it."""
    out: list[str] = []
    placed = False
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        if name not in names:
            out.append(argv[i])
            i += 1
            continue
        i += 1 if eq else 2
        if value is not None and not placed:
            out += [name, value]
            placed = True
    if value is not None and not placed:
        out += [names[0], value]
    return out


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["rlstream", *argv])


def apply_strategy(strategy: str | None, mode: str | None, rest: list[str], argv: Sequence[str]) -> tuple[str, list[str]]:
    """``(mode, rest)`` of ``train --strategy``: its mode, and ``--algo`` added to the flags left
    for the config (``rest``) where none is given. An explicit ``--mode`` or ``--algo`` that
    contradicts it is refused (``SystemExit``) with the command that says what they say."""
    if strategy is None:
        return mode or "colocated", rest
    want, family, default_algo = STRATEGIES[strategy]
    algo = given(rest, ("--algo",))
    clash = [f"--mode {mode}"] if mode is not None and mode != want else []
    clash += [f"--algo {algo}"] if algo is not None and algo not in family else []
    if clash:
        fixed = with_flag(with_flag(with_flag(argv, ("--strategy",), None), ("--mode",), mode or want),
                          ("--algo",), algo or default_algo)
        raise SystemExit(f"--strategy {strategy} means --mode {want} with an {strategy} algorithm "
                         f"({', '.join(family)}), not {' and '.join(clash)}; say what you mean with --mode and "
                         f"--algo alone: {command_line(fixed)}")
    return want, rest if algo is not None else [*rest, "--algo", default_algo]


def check_runs_here(env_id: str, device: str, learners: int | None, mode: str, argv: Sequence[str],
                    env_kwargs: Mapping[str, Any] | None = None) -> None:
    """Refuse (``SystemExit``, one line) a ``train`` that cannot start here: an env that cannot be
    made (an old version: the command with the newest), a CUDA device this machine lacks (the
    command on CPU, the same number of ranks), several learner ranks in co-located mode.
    ``env_kwargs``: the preset's, made as the run will make them (``check_env_id`` remembers it)."""
    from actor.envs import check_env_id, newest_version

    problems: list[str] = []
    fixed: list[str] | None = list(argv)
    try:
        check_env_id(env_id, env_kwargs)
    except ValueError as e:
        problems.append(str(e))
        module, sep, bare = env_id.rpartition(":")
        try:
            newer = newest_version(env_id)
        except ValueError:
            newer = None
        if newer and newer != bare and fixed is not None:
            fixed = with_flag(fixed, ENV_FLAGS, f"{module}{sep}{newer}")
        else:
            fixed = None  # a misspelling has no equivalent: the message says what to check
    devices = _devices(device, learners, problems)
    if devices is not None:
        ranks = len(devices)
        missing = _missing(devices, problems)
        if missing:
            have = missing[1]
            problems.append(f"--learner.device {device}: this machine has "
                            + ("no CUDA device" if have == 0 else f"{have} CUDA device(s), not {', '.join(missing[0])}"))
            if fixed is not None:
                fixed = with_flag(fixed, ("--learner.device",), "cpu")
                if ranks > 1 and given(fixed, ("--learner.learners",)) is None:
                    fixed = with_flag(fixed, ("--learner.learners",), str(ranks))
        if mode == "colocated" and ranks > 1:
            problems.append(f"co-located mode trains one learner, not {ranks} ranks (--learner.device {device}"
                            + (f", --learner.learners {learners}" if learners else "") + "): ranks need --mode decoupled")
            fixed = None
    if problems:
        raise SystemExit("; ".join(problems)
                         + (f"; the same run here: {command_line(fixed)}" if fixed is not None else ""))


def _devices(device: str, learners: int | None, problems: list[str]) -> list[str] | None:
    """The learner ranks' devices (``learner.distributed.parse_devices``); None: refused."""
    spec = device.strip()
    if "," not in spec and not learners:
        return [spec]  # one rank (no torch import for the common case)
    from learner.distributed import parse_devices

    try:
        return parse_devices(spec, learners)
    except ValueError as e:
        problems.append(str(e))
        return None


def _missing(devices: list[str], problems: list[str]) -> tuple[list[str], int] | None:
    """(the CUDA devices of ``devices`` this machine lacks, how many it has), None: none lacking."""
    if not any(d.startswith("cuda") for d in devices):
        return None
    import torch

    from learner.distributed import missing_devices

    have = torch.cuda.device_count()
    try:
        missing = missing_devices(devices, have)
    except ValueError as e:
        problems.append(str(e))
        return None
    return (missing, have) if missing else None


def check_redis(snapshot_store: str | None, redis_url: str | None, timeout_s: float = 3.0, *,
                unreachable_ok: bool = False) -> None:
    """Refuse (``SystemExit``, one line) a run whose Redis does not answer a PING within
    ``timeout_s``: the snapshot store's (``redis://`` ``--snapshot-store``) or the claim checks'
    (``--deploy.redis-url``, ``REDIS_URL``), before the run directory is made. Passwords are never shown.
    ``unreachable_ok`` (a role, which a supervisor may restart while Redis restarts too): only a
    Redis that refuses the password is refused; one that does not answer is left to the role's
    own retries."""
    from urllib.parse import urlsplit, urlunsplit

    for url, flag in ((snapshot_store, "--learner.snapshot-store (or RLSTREAM_SNAPSHOT_STORE)"),
                      (redis_url, "--deploy.redis-url (or REDIS_URL)")):
        parts = urlsplit(str(url or ""))
        if parts.scheme not in ("redis", "rediss", "unix"):
            continue
        import redis

        shown = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], query=""))
        client = redis.Redis.from_url(urlunsplit(parts._replace(query="")), socket_connect_timeout=timeout_s,
                                      socket_timeout=timeout_s)
        try:
            client.ping()
        except redis.exceptions.AuthenticationError as e:
            raise SystemExit(f"Redis at {shown} ({flag}) refused the credentials ({e}): put the right password "
                             "in the URL (redis://:PASSWORD@host:port/0)") from None
        except (redis.exceptions.RedisError, OSError) as e:
            if unreachable_ok:
                continue
            raise SystemExit(f"no Redis answers at {shown} ({flag}): {str(e).rstrip('.')}; start one there "
                             f"(redis-server --port {parts.port or 6379}) or point {flag.split()[0]} at one") from None
        finally:
            client.close()
