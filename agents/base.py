"""Plumbing shared by the algorithms: policy config, optimiser step, masking helpers.

Nothing here knows about a particular objective; each algorithm module owns its
loss and its ``update``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from config.algos import ALGO_DEFAULTS
from agents.capture import CapturedStep, CaptureStats
from agents.networks import Policy

__all__ = [
    "PolicyConfig",
    "BaseAlgorithm",
    "build_policy",
    "episode_mask",
    "rollout_mask",
    "masked_mean",
    "explained_variance",
    "frozen_copy",
    "minibatch_indices",
    "accumulate",
    "accumulate_tensors",
]


@dataclass(frozen=True)
class PolicyConfig:
    """Network and optimiser settings common to every algorithm."""

    hidden: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the actor and critic MLPs."""
    activation: str = "tanh"
    """Hidden activation: tanh | relu | elu | gelu | silu."""
    init_log_std: float = 0.0
    """Initial state-independent log std of the Gaussian policy."""
    normalize_obs: bool = True
    """Normalise observations with running mean/std (stats live in the policy state_dict)."""
    obs_clip: float = 10.0
    """Clip of normalised observations."""
    learning_rate: float = 3e-4
    """Adam learning rate."""
    adam_eps: float = 1e-5
    """Adam epsilon (CleanRL uses 1e-5, not torch's 1e-8)."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip; <= 0 disables it."""
    seed: int = 0
    """Seed of the learner-side generator (minibatch shuffling)."""
    action_nvec: tuple[int, ...] = ()
    """Discrete actions: choices per action component (categorical head; set from the env's
    Discrete/MultiDiscrete space by the wiring). Empty: continuous actions, Gaussian head."""
    capture_update: bool = False
    """Run each minibatch step captured (``BaseAlgorithm.enable_capture``: compiled whole by
    torch.compile). Part of the config, so a run's provenance records it and ``rlstream verify``
    replays the same path."""


def build_policy(config: PolicyConfig, obs_dim: int, act_dim: int) -> Policy:
    """The ``Policy`` an algorithm with ``config`` trains (and its actors must construct)."""
    return Policy(
        obs_dim,
        act_dim,
        hidden=tuple(config.hidden),
        activation=config.activation,
        init_log_std=config.init_log_std,
        normalize_obs=config.normalize_obs,
        obs_clip=config.obs_clip,
        nvec=config.action_nvec or None,
    )


def frozen_copy(module: nn.Module) -> nn.Module:
    """Deep copy with ``requires_grad=False`` everywhere, in eval mode."""
    ref = copy.deepcopy(module)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


def episode_mask(terminated: Tensor, truncated: Tensor) -> Tensor:
    """``[T, N]`` bool: steps up to and including each column's first episode end.

    Used by the algorithms that treat a column as one rollout (GRPO/DAPO/TB).
    """
    done = (terminated | truncated).to(torch.int64)
    ended_before = torch.cumsum(done, dim=0) - done
    return ended_before == 0


def rollout_mask(terminated: Tensor, truncated: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """``episode_mask`` restricted to the valid steps ``mask`` (padding excluded) when given.

    The valid steps of a column-as-rollout batch (GRPO/DAPO/TB, AGRO's group baseline).
    """
    first = episode_mask(terminated, truncated)
    return first if mask is None else first & mask


def masked_mean(x: Tensor, mask: Optional[Tensor] = None, weight: Optional[Tensor] = None) -> Tensor:
    """``sum(x * weight * mask) / count(mask)``; plain ``mean`` when both are None.

    The weights are *not* renormalised, so down-weighted samples really count less.
    """
    if weight is not None:
        x = x * weight
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def explained_variance(y_pred: Tensor, y_true: Tensor) -> float:
    """``1 - Var[y - y_pred] / Var[y]`` (nan if ``Var[y] == 0``), population variances."""
    var_y = torch.var(y_true, unbiased=False)
    if float(var_y) == 0.0:
        return float("nan")
    return float(1.0 - torch.var(y_true - y_pred, unbiased=False) / var_y)


def accumulate(sums: dict[str, float], stats: Mapping[str, Any]) -> None:
    """Add float values of ``stats`` (tensors detached) into ``sums``."""
    for k, v in stats.items():
        sums[k] = sums.get(k, 0.0) + float(v.detach() if isinstance(v, Tensor) else v)


def accumulate_tensors(sums: dict[str, Tensor], stats: Mapping[str, Any]) -> None:
    """``accumulate`` with no host sync per step: float64 tensor sums (read once, at the end)."""
    for k, v in stats.items():
        v = v.detach().double() if isinstance(v, Tensor) else torch.tensor(float(v), dtype=torch.float64)
        sums[k] = sums[k] + v if k in sums else v


def minibatch_indices(n: int, num_minibatches: int, generator: torch.Generator, device: torch.device) -> Iterator[Tensor]:
    """Shuffle ``range(n)`` and split into chunks of ``max(1, n // num_minibatches)`` (CleanRL's split)."""
    size = max(1, n // max(1, num_minibatches))
    perm = torch.randperm(n, generator=generator).to(device)
    for start in range(0, n, size):
        yield perm[start : start + size]


class BaseAlgorithm:
    """Holds the policy, optimiser, step counter and RNG; implements state_dict plumbing.

    Subclasses set ``name`` (``is_on_policy`` follows from its row of ``config.algos``), implement
    ``update`` and may add learner-side state by overriding
    ``_extra_state`` / ``_load_extra_state``.
    """

    name: str = "base"
    is_on_policy: bool = True
    minibatch_size: Optional[int] = None
    """Transitions per minibatch set from outside (the learner's dynamic batch size,
    ``learner.minibatch``); None: the config's ``num_minibatches`` split of each batch."""

    def minibatches(self, n: int, num_minibatches: int) -> int:
        """Minibatches per pass over ``n`` samples: ``num_minibatches``, or ``n // minibatch_size``."""
        if self.minibatch_size is None:
            return num_minibatches
        return max(1, n // max(1, int(self.minibatch_size)))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name in ALGO_DEFAULTS:
            cls.is_on_policy = ALGO_DEFAULTS[cls.name].on_policy

    def __init__(self, config: PolicyConfig, obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        self.config = config
        self.obs_dim = int(obs_dim)
        self.act_dim = int(act_dim)
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):  # deterministic init without touching the global RNG
            torch.manual_seed(config.seed)
            self.policy: Policy = build_policy(config, obs_dim, act_dim).to(self.device)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step = 0
        self.optimizer = self._make_optimizer(list(self.policy.parameters()))
        if config.capture_update:
            self.enable_capture()

    def _make_optimizer(self, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        # fused: one kernel for all parameters instead of a dozen ops per parameter (the same
        # Adam update; on small policies the per-op overhead is most of the step)
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.Adam(params, lr=self.config.learning_rate, eps=self.config.adam_eps,
                                **({"fused": True} if fused else {}))

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            self._set_group_lr(group, lr)

    @staticmethod
    def _set_group_lr(group: dict, lr: float) -> None:
        """A float rate, or filled into the captured update's tensor rate (no recompile)."""
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr

    # ---- the captured update (agents.capture) ---------------------------------------------
    capture: Optional[CaptureStats] = None
    """Counters of the captured update when it is on (``enable_capture``); None: eager."""

    def enable_capture(self, max_shapes: int = 8, mode: Optional[str] = None, backend: str = "inductor") -> None:
        """Run each minibatch step (forward, loss, backward, clip, Adam) compiled as one
        ``torch.compile`` unit. Adam becomes the traceable single-tensor one with a tensor learning
        rate (``capturable`` on CUDA), so annealing never recompiles; its state carries over."""
        state = self.optimizer.state_dict()
        cuda = self.device.type == "cuda"
        groups = [{**{k: v for k, v in g.items() if k not in ("lr", "fused", "foreach", "capturable")},
                   "lr": torch.tensor(float(g["lr"]), device=self.device if cuda else "cpu")}
                  for g in self.optimizer.param_groups]
        self.optimizer = torch.optim.Adam(groups, foreach=False, fused=False, capturable=cuda)
        self._load_optimizer(state)
        self.capture = CaptureStats()
        self._capture_args = (max_shapes, mode, backend)
        self._captured: dict[str, CapturedStep] = {}

    def _load_optimizer(self, state: Mapping[str, Any]) -> None:
        """Load optimizer ``state`` (from either path), keeping this optimizer's kernel flags
        (fused / traceable) and the captured update's tensor rates (filled in place)."""
        rates = [g["lr"] for g in self.optimizer.param_groups]
        flags = {k: self.optimizer.param_groups[0][k] for k in ("foreach", "fused", "capturable")
                 if k in self.optimizer.param_groups[0]}
        self.optimizer.load_state_dict(state)
        for group, rate in zip(self.optimizer.param_groups, rates):
            group.update(flags)
            if isinstance(rate, Tensor):
                rate.fill_(float(group["lr"]))
                group["lr"] = rate

    def _step_body(self, loss_fn: Any, *args: Any) -> tuple[Any, Tensor]:
        """One minibatch step: ``loss_fn(*args) -> (loss, stats)``, backward, clip, Adam step.
        Returns ``(stats, pre-clip grad norm)``."""
        loss, stats = loss_fn(*args)
        norm = self._gradient_step(loss)
        return stats, norm

    def _minibatch_step(self, loss_fn: Any, *args: Any) -> tuple[Any, Tensor]:
        """``_step_body`` eagerly, or captured (compiled per signature) when ``enable_capture`` ran."""
        if self.capture is None:
            return self._step_body(loss_fn, *args)
        name = loss_fn.__name__
        step = self._captured.get(name)
        if step is None:
            def body(*a: Any, _fn: Any = loss_fn) -> tuple[Any, Tensor]:
                return self._step_body(_fn, *a)

            step = self._captured[name] = CapturedStep(body, self.capture, *self._capture_args)
        return step(*args)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _apply_gradients(self, loss: Tensor) -> float:
        """Backward, clip the global grad norm, step. Returns the pre-clip grad norm."""
        return float(self._gradient_step(loss))

    def _gradient_step(self, loss: Tensor) -> Tensor:
        """``_apply_gradients`` returning the pre-clip grad norm as a tensor (no host sync)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.config.max_grad_norm and self.config.max_grad_norm > 0:
            norm = nn.utils.clip_grad_norm_(params, self.config.max_grad_norm, foreach=True)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])) if params else torch.zeros(())
        self.optimizer.step()
        return norm

    # ---- reference policy (GRPO KL, AGRO/TBA regulariser, DPO) -------------------------------
    ref_policy: Optional[Policy] = None

    def _init_reference(self) -> None:
        """Create the frozen reference copy of the current policy."""
        self.ref_policy = frozen_copy(self.policy)

    def sync_reference(self) -> None:
        """Overwrite the reference with the current policy (weights and normaliser)."""
        if self.ref_policy is None:
            self._init_reference()
        else:
            self.ref_policy.load_state_dict(self.policy.state_dict())

    def update(self, batch: Any) -> dict[str, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- state -------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {
            "algo": self.name,
            "config": dataclasses.asdict(self.config),
            "step": self.step,
            "policy": self.policy.state_dict(),
            "optimizer": self._optimizer_state(),
            "generator": self.generator.get_state(),
            **({"ref_policy": self.ref_policy.state_dict()} if self.ref_policy is not None else {}),
            **self._extra_state(),
        }

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state_dict with plain float rates (the same snapshot either path)."""
        state = self.optimizer.state_dict()
        state["param_groups"] = [{**g, "lr": float(g["lr"])} for g in state["param_groups"]]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("algo", self.name) != self.name:
            raise ValueError(f"state is for {state.get('algo')!r}, this is {self.name!r}")
        self.policy.load_state_dict(state["policy"])
        self._load_optimizer(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        if self.ref_policy is not None and "ref_policy" in state:
            self.ref_policy.load_state_dict(state["ref_policy"])
        self._load_extra_state(state)
