"""The GPU image (compose/Dockerfile.gpu) builds, carries CUDA torch and NVML, and its learner,
started as docker-compose.gpu.yml and k8s/learner.yaml start it (``--device cuda``), says at once
that no GPU is visible where none is (this machine has none), instead of a torch traceback."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import COMPOSE, podman, podman_env

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(2400)]
IMAGE = "localhost/rlstream-gpu:latest"


@pytest.fixture(scope="module")
def gpu_image(podman_ready) -> str:
    res = subprocess.run(["bash", str(COMPOSE / "build-images.sh"), "rlstream-gpu"], env=podman_env(),
                         capture_output=True, text=True, timeout=2400)
    assert res.returncode == 0, res.stderr[-4000:]
    return IMAGE


def test_the_gpu_image_has_cuda_torch_and_nvml(gpu_image) -> None:
    res = podman("run", "--rm", "--network", "none", gpu_image, "python", "-c",
                 "import torch, pynvml; print(torch.version.cuda is not None, torch.cuda.is_available())",
                 check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "False"]  # a CUDA build; no GPU on this machine


def test_the_gpu_learner_says_no_gpu_is_visible(gpu_image) -> None:
    inspect = podman("image", "inspect", "--format", "{{json .Config.Env}}", gpu_image).stdout
    assert "NVIDIA_VISIBLE_DEVICES=all" in inspect and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in inspect
    res = podman("run", "--rm", "--network", "none", gpu_image, "rlstream", "learner", "--log-json", "--device",
                 "cuda", "--run-dir", "/tmp/run", "--metrics-port", "-1", check=False, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--device cuda, but no GPU is visible to this process" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
