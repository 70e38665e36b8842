"""A module built to receive weights is not initialised first: ``load_state`` builds it empty
(meta device, then uninitialised memory) and its strict load fills every tensor, so no orthogonal
init (seconds of QR at 10M parameters) runs for nothing; the result is the weights exactly."""

from __future__ import annotations

import pytest
import torch

from agents.networks import Policy
from streams.policies import arch_of, load_state
from streams.policy.arch import policy_from_arch
from streams.policy.errors import PolicyLoadError


def test_load_state_runs_no_init_and_fills_every_tensor(monkeypatch):
    torch.manual_seed(0)
    src = Policy(5, 2, hidden=(32, 16), activation="relu")
    with torch.no_grad():
        src.obs_rms.mean.add_(3.0)
        src.obs_rms.count.fill_(77.0)
    state = {k: v.clone() for k, v in src.state_dict().items()}

    real_init = torch.nn.init.orthogonal_

    def no_init(tensor, *a, **k):
        if tensor.device.type != "meta":  # on the meta device it is shapes only: no QR runs
            raise AssertionError("a module about to be loaded was initialised")
        return real_init(tensor, *a, **k)

    monkeypatch.setattr(torch.nn.init, "orthogonal_", no_init)
    got = load_state(state, arch_of(src))
    assert arch_of(got) == arch_of(src) and not got.training
    for k, v in src.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
        assert got.state_dict()[k].device.type == "cpu"
    obs = torch.randn(4, 5)
    assert torch.equal(got.log_prob(obs, torch.zeros(4, 2)), src.eval().log_prob(obs, torch.zeros(4, 2)))
    monkeypatch.undo()
    with pytest.raises(PolicyLoadError):  # a state that does not fill the module is still refused
        load_state({k: v for k, v in state.items() if k != "obs_rms.count"}, arch_of(src))


def test_a_built_module_is_initialised_unless_asked():
    arch = arch_of(Policy(3, 1, hidden=(8,)))
    p = policy_from_arch(arch)
    w = p.net.actor_mean[0].weight
    assert torch.allclose(w.T @ w, 2.0 * torch.eye(3), atol=1e-4)  # orthogonal columns, gain sqrt(2)
    assert policy_from_arch(arch, empty=True).net.actor_mean[0].weight.shape == (8, 3)
