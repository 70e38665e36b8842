import numpy as np
import pytest
import torch

from agents.core import Algorithm, TrajectoryBatch
from agents.registry import ALGORITHMS, make_algorithm


def _arrays(T=4, N=3, D=5, A=2):
    rng = np.random.default_rng(0)
    return dict(
        obs=rng.normal(size=(T, N, D)).astype(np.float32),
        actions=rng.normal(size=(T, N, A)).astype(np.float32),
        rewards=rng.normal(size=(T, N)),  # float64 -> converted
        terminated=np.zeros((T, N), dtype=np.uint8),  # uint8 -> bool
        truncated=np.zeros((T, N), dtype=bool),
        behaviour_logp=rng.normal(size=(T, N)).astype(np.float32),
        last_obs=rng.normal(size=(N, D)).astype(np.float32),
    )


def test_from_numpy_is_zero_copy_for_float32_and_converts_others():
    arr = _arrays()
    b = TrajectoryBatch.from_numpy(**arr, staleness_versions=2, group_id=np.array([0, 0, 1]))
    arr["obs"][0, 0, 0] = 123.0
    assert float(b.obs[0, 0, 0]) == 123.0  # shares memory
    assert b.rewards.dtype == torch.float32 and b.terminated.dtype == torch.bool and b.group_id.dtype == torch.int64
    assert b.num_steps == 4 and b.num_columns == 3
    assert b.staleness_tensor("staleness_versions").shape == (4, 3)
    assert float(b.staleness_tensor("staleness_versions")[1, 2]) == 2.0
    assert b.values is None and b.is_rho is None  # optional fields stay None (= recompute / ones)


def test_from_numpy_rejects_bad_shapes_and_unknown_fields():
    arr = _arrays()
    with pytest.raises(ValueError, match="rewards"):
        TrajectoryBatch.from_numpy(**{**arr, "rewards": np.zeros((4, 2))})
    with pytest.raises(ValueError, match="last_obs"):
        TrajectoryBatch.from_numpy(**{**arr, "last_obs": np.zeros((3, 4), np.float32)})
    with pytest.raises(ValueError, match="staleness_versions"):
        TrajectoryBatch.from_numpy(**arr, staleness_versions=np.zeros((4, 2)))
    with pytest.raises(TypeError, match="bogus"):
        TrajectoryBatch.from_numpy(**arr, bogus=1)


def test_batch_is_frozen_and_to_device_keeps_every_field():
    import dataclasses

    b = TrajectoryBatch.from_numpy(**_arrays(), staleness_versions=1, group_id=np.array([0, 0, 1]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.obs = None  # type: ignore[misc]
    c = b.to(torch.device("cpu"))
    assert type(c) is TrajectoryBatch
    for f in dataclasses.fields(b):
        x, y = getattr(b, f.name), getattr(c, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and y.device.type == "cpu" and torch.equal(x, y), f.name
        else:
            assert y == x, f.name


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_satisfies_the_protocol(name):
    algo = make_algorithm(name, 3, 2)
    assert isinstance(algo, Algorithm)
    assert isinstance(algo.is_on_policy, bool)
    sd = algo.state_dict()
    assert {"policy", "optimizer", "step"} <= set(sd)
