"""The GPU image (compose/Dockerfile.gpu) builds, carries CUDA torch and NVML, and its learner,
started as docker-compose.gpu.yml and k8s/learner.yaml start it (``--learner.device cuda``), says at once
that no GPU is visible where none is (this machine has none), instead of a torch traceback."""

from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import COMPOSE, podman, podman_env

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(2400)]
IMAGE = "localhost/rlstream-gpu:latest"


@pytest.fixture(scope="module")
def gpu_image(podman_ready) -> str:
    """The GPU image, kept up to date where it exists. Built from nothing only with
    RLSTREAM_DEPLOY_GPU_IMAGE=1: a first build is ~4 GB more and 6-10 minutes, which .ci/run's time
    on a fresh machine cannot spare (compose/build-images.sh rlstream-gpu builds it by hand)."""
    exists = podman("image", "exists", IMAGE, check=False).returncode == 0
    if not exists and os.environ.get("RLSTREAM_DEPLOY_GPU_IMAGE") != "1":
        pytest.skip(f"{IMAGE} not built here (compose/build-images.sh rlstream-gpu, or RLSTREAM_DEPLOY_GPU_IMAGE=1)")
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
    res = podman("run", "--rm", "--network", "none", gpu_image, "rlstream", "learner", "--log-json", "--learner.device",
                 "cuda", "--run-dir", "/tmp/run", "--metrics-port", "-1", check=False, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--learner.device cuda, but no GPU is visible to this process" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_the_rlstream_image_compiles_a_captured_update(images) -> None:
    """torch.compile works in the image (g++ and Python's headers): the learner's captured update
    crashed without them (InvalidCxxCompiler)."""
    code = ("import torch; f = torch.compile(lambda x: torch.tanh(x) * 2 + 1); "
            "print(f(torch.zeros(4)).tolist())")
    res = podman("run", "--rm", "--network", "none", images["rlstream"], "python", "-c", code, check=False,
                 timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[1.0, 1.0, 1.0, 1.0]"
