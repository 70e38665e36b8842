"""An actor's envs in a child process: ``RolloutProcess`` has ``Rollout``'s interface, and its
``collect`` waits on a pipe while the child steps the envs, so the calling thread holds no GIL
meanwhile. Co-located ``--actor.overlap`` uses it to collect the next fragment while the learner's
update runs in the parent: two processes, two cores, where two threads of one process take turns.

The child is started with ``spawn`` (no forked torch or broker-client state) and builds the
envs itself from the ``ActorConfig``; the policy's weights cross the pipe once per version, as
numpy arrays (a few dozen KB for the MuJoCo MLPs), and fragments come back as SampleBatches.
The pipe is private to the two processes and carries only objects the parent or the child built
itself (a copy of the policy module the parent's subscriber decoded, its weights, the batches the
child collected); topic data never crosses it. An env error in the child is raised in the parent (``NonFiniteEnvError`` as itself,
so the actor rejects the fragment as usual); a child that dies is a ``RolloutProcessError``
naming its exit code. The child exits when the parent closes it, or when the pipe breaks (the
parent died).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from schemas.events import SampleBatch

START_S = 120.0
"""How long the child may take to import torch and Gymnasium and build its envs."""
CLOSE_S = 10.0


class RolloutProcessError(RuntimeError):
    """The rollout child died or could not start."""


def _serve(conn, config) -> None:
    """The child: build the envs, then answer ``collect`` / ``reset`` / ``close`` requests."""
    import torch

    from actor.rollout import Rollout

    torch.set_num_threads(1)
    try:
        rollout = Rollout(config)
    except BaseException as e:  # noqa: BLE001 (sent to the parent, which raises it)
        conn.send(("error", e))
        return
    conn.send(("ready", rollout.spec))
    policy = None
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            op = msg[0]
            if op == "close":
                return
            try:
                if op == "collect":
                    _, module, state, version, T, seq = msg
                    if module is not None:
                        policy = module
                    if state is not None:
                        policy.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
                    conn.send(("ok", rollout.collect(policy, version, T, seq)))
                elif op == "reset":
                    rollout.reset()
                    conn.send(("ok", None))
                else:
                    conn.send(("error", ValueError(f"unknown request {op!r}")))
            except Exception as e:  # noqa: BLE001 (raised in the parent)
                try:
                    conn.send(("error", e))
                except Exception:  # noqa: BLE001 (an exception that does not pickle: its text)
                    conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        rollout.close()
        conn.close()


class RolloutProcess:
    """``Rollout`` over a spawned child process (module doc). ``config.swap_every`` must be 0:
    the child cannot ask the parent's subscriber mid-fragment."""

    def __init__(self, config, start_s: float = START_S) -> None:
        if config.swap_every:
            raise ValueError("a rollout process collects whole fragments: swap_every must be 0")
        self.config = config
        self.cut_fragments = self.inflight_swaps = 0
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, config), name=f"rlstream-rollout-{config.actor_id}",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._sent: tuple[int, int] | None = None  # (id(policy), version) the child has
        try:
            self.spec = self._answer(start_s, "start")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _died(self, when: str) -> RolloutProcessError:
        """The error for a broken pipe: the child is gone (reaped, so its exit code is known)."""
        self._proc.join(CLOSE_S)
        return RolloutProcessError(f"rollout process {self._proc.pid} died {when} (exit code {self._proc.exitcode})")

    def _request(self, msg: tuple, what: str) -> Any:
        try:
            self._conn.send(msg)
        except OSError as e:  # (BrokenPipeError)
            raise self._died(f"before {what}") from e
        return self._answer(None, what)

    def _answer(self, timeout: float | None, what: str) -> Any:
        try:
            if timeout is not None and not self._conn.poll(timeout):
                raise RolloutProcessError(f"rollout process {self._proc.pid} did not answer {what} within {timeout:.0f} s")
            kind, value = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died(f"during {what}") from e
        if kind == "error":
            raise value
        return value

    def collect(self, policy, version: int, T: int, seq: int, newer: Callable[[], Any] | None = None) -> SampleBatch:
        """``Rollout.collect`` in the child (``newer`` is not supported: see the class doc)."""
        if newer is not None:
            raise ValueError("a rollout process cannot swap policies within a fragment")
        key = (id(policy), version)
        # A new module goes as a copy (torch shares a sent module's tensors with the child, and the
        # subscriber loads every later version into this one in place); each version's weights
        # then go by value, as numpy arrays, so the child never sees a load mid-fragment.
        module = copy.deepcopy(policy) if self._sent is None or key[0] != self._sent[0] else None
        state = ({k: v.detach().cpu().numpy().copy() for k, v in policy.state_dict().items()}
                 if key != self._sent else None)
        batch = self._request(("collect", module, state, version, T, seq), "collect")
        self._sent = key
        return batch

    def reset(self) -> None:
        self._request(("reset",), "reset")

    def close(self) -> None:
        """Ask the child to close its envs and exit; kill it if it has not within ``CLOSE_S``."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(CLOSE_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(CLOSE_S)
        self._conn.close()
