"""One whole ``PPO.update()`` against an independent, hand-written CleanRL-style step.

The reference below shares no code with ``agents.ppo``: it rebuilds the Gaussian from the same
(copied) layers with ``torch.distributions``, runs GAE as CleanRL's backward loop, normalises
advantages per minibatch, adds the entropy bonus, clips the global grad norm, steps a plain
(unfused) Adam and stops the epochs once an epoch's mean approx KL passes ``target_kl`` (the
documented rule). Parameters after the update and every reported metric must agree to 1e-6."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributions import Normal

from agents.core import TrajectoryBatch
from agents.ppo import PPO, PPOConfig

torch.set_num_threads(1)

OBS, ACT, T, N = 3, 2, 16, 4
CFG = dict(update_epochs=6, num_minibatches=4, clip_coef=0.2, ent_coef=0.05, vf_coef=0.5, max_grad_norm=0.5,
           learning_rate=3e-3, anneal_lr=True, total_updates=4, gamma=0.97, gae_lambda=0.9, hidden=(16, 16),
           normalize_obs=False, normalize_reward=False, seed=11)


def make_batch(algo: PPO) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(5)
    obs = torch.randn(T, N, OBS, generator=g)
    actions = torch.randn(T, N, ACT, generator=g)
    with torch.no_grad():  # a slightly different behaviour policy: ratios start off 1, some clip
        logp = algo.policy.log_prob(obs, actions) + 0.3 * torch.randn(T, N, generator=g)
    term = torch.rand(T, N, generator=g) < 0.1
    trunc = (torch.rand(T, N, generator=g) < 0.08) & ~term
    return TrajectoryBatch(obs=obs, actions=actions, rewards=3.0 * torch.randn(T, N, generator=g), terminated=term,
                           truncated=trunc, behaviour_logp=logp, last_obs=torch.randn(N, OBS, generator=g),
                           next_obs_final=torch.randn(T, N, OBS, generator=g))


class Agent(torch.nn.Module):
    """CleanRL's ``Agent`` shape: critic, actor_mean, actor_logstd (weights copied in)."""

    def __init__(self, net) -> None:
        super().__init__()
        self.critic = copy.deepcopy(net.critic)
        self.actor_mean = copy.deepcopy(net.actor_mean)
        self.actor_logstd = copy.deepcopy(net.actor_logstd)

    def get_value(self, x):
        return self.critic(x).flatten()

    def get_action_and_value(self, x, action):
        mean = self.actor_mean(x)
        dist = Normal(mean, self.actor_logstd.expand_as(mean).exp())
        return dist.log_prob(action).sum(1), dist.entropy().sum(1), self.critic(x).flatten()


def reference_update(agent: Agent, b: TrajectoryBatch, seed: int, cfg: dict, target_kl: float | None):
    """CleanRL ppo_continuous_action.py's update, written out; returns the metrics PPO reports."""
    lr = (1.0 - 0 / cfg["total_updates"]) * cfg["learning_rate"]
    opt = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    gamma, lam = cfg["gamma"], cfg["gae_lambda"]
    with torch.no_grad():
        values = agent.get_value(b.obs.reshape(-1, OBS)).reshape(T, N)
        last_value = agent.get_value(b.last_obs)
        final_value = agent.get_value(b.next_obs_final.reshape(-1, OBS)).reshape(T, N)
        advantages = torch.zeros(T, N)
        lastgaelam = torch.zeros(N)
        for t in reversed(range(T)):
            nextvalues = last_value if t == T - 1 else values[t + 1]
            nextvalues = torch.where(b.truncated[t], final_value[t], nextvalues)  # bootstrap a time limit
            nextvalues = torch.where(b.terminated[t], torch.zeros(N), nextvalues)
            nextnonterminal = (~(b.terminated[t] | b.truncated[t])).float()
            delta = b.rewards[t] + gamma * nextvalues - values[t]
            advantages[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
        returns = advantages + values
    b_obs, b_actions = b.obs.reshape(-1, OBS), b.actions.reshape(-1, ACT)
    b_logprobs, b_adv = b.behaviour_logp.reshape(-1), advantages.reshape(-1)
    b_returns, b_values = returns.reshape(-1), values.reshape(-1)
    n = T * N
    mb_size = n // cfg["num_minibatches"]
    clip = cfg["clip_coef"]
    gen = torch.Generator().manual_seed(seed)
    rows, epochs = [], 0
    for _ in range(cfg["update_epochs"]):
        inds = torch.randperm(n, generator=gen)
        epoch_kl = []
        for start in range(0, n, mb_size):
            mb = inds[start:start + mb_size]
            newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
            logratio = newlogprob - b_logprobs[mb]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfrac = ((ratio - 1.0).abs() > clip).float().mean()
            mb_adv = b_adv[mb]
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()
            v_unclipped = (newvalue - b_returns[mb]) ** 2
            v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -clip, clip)
            v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb]) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss - cfg["ent_coef"] * entropy_loss + v_loss * cfg["vf_coef"]
            opt.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(agent.parameters(), cfg["max_grad_norm"])
            opt.step()
            epoch_kl.append(float(approx_kl))
            rows.append({"loss_policy": pg_loss.item(), "loss_value": v_loss.item(), "loss_entropy": -entropy_loss.item(),
                         "loss_total": loss.item(), "entropy": entropy_loss.item(), "approx_kl": float(approx_kl),
                         "old_approx_kl": float(old_approx_kl), "clipfrac": float(clipfrac),
                         "ratio_mean": ratio.mean().item(), "grad_norm": float(grad_norm)})
        epochs += 1
        if target_kl is not None and sum(epoch_kl) / len(epoch_kl) > target_kl:
            break
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    out.update(epochs_run=float(epochs), learning_rate=lr, adv_mean=float(b_adv.mean()), adv_std=float(b_adv.std()),
               value_mean=float(b_values.mean()), return_mean=float(b_returns.mean()), num_samples=float(n))
    return out


@pytest.mark.parametrize("path", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("target_kl", [None, 0.05], ids=["all-epochs", "early-stop"])
def test_update_equals_a_hand_written_cleanrl_step(target_kl, path):
    """Both update paths: eager, and captured (each minibatch step one compiled graph)."""
    algo = PPO(PPOConfig(**CFG, target_kl=target_kl), OBS, ACT)
    if path == "captured":
        algo.enable_capture()
    batch = make_batch(algo)
    agent = Agent(algo.policy.net)
    want = reference_update(agent, batch, CFG["seed"], CFG, target_kl)
    got = algo.update(batch)
    # the parts this test is about really take part in the update
    assert got["grad_norm"] > 2 * CFG["max_grad_norm"]  # clipping bites
    assert got["clipfrac"] > 0 and got["entropy"] != 0
    if target_kl is None:
        assert got["epochs_run"] == CFG["update_epochs"]
    else:
        assert got["epochs_run"] == 4  # epoch means of approx_kl: 0.0495, 0.0483, 0.0495, 0.0503 > 0.05
    if path == "captured":  # every step ran compiled, one graph for the one minibatch shape
        assert algo.capture.compiles == 1 and algo.capture.eager_steps == 0
        assert algo.capture.captured_steps == got["epochs_run"] * CFG["num_minibatches"]
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6, rel=1e-6), k
    params = dict(agent.named_parameters())
    for name, p in algo.policy.net.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=0, atol=1e-6, msg=name)
