"""``simulation.deterministic``: a seed fixes a run on the GPU as it does on the CPU.

The CUDA tests run where a GPU is (they are skipped in CI, which has none); the CPU tests
check that the option changes nothing on the CPU and that a bad environment is a clear error.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.models import build_model
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.training import TrainSettings, get_weights, train, use_deterministic_kernels

MNIST = (1, 28, 28)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def restore_torch_flags(monkeypatch):
    """The deterministic switches are process-wide: put them back after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]


def briggs_cnn_trained(device: torch.device, seed: int = 0, samples: int = 600) -> list[np.ndarray]:
    """Briggs et al.'s CNN after samples / 10 SGD steps of batch 10 on fixed random MNIST-shaped data."""
    data = torch.Generator().manual_seed(1)
    x, y = torch.rand(samples, *MNIST, generator=data), torch.randint(0, 10, (samples,), generator=data)
    torch.manual_seed(seed)
    model = build_model("cnn_briggs", MNIST, 10)
    train(model, x, y, TrainSettings(1, 10, 0.1, "sgd", 0.0, 0.0), torch.Generator().manual_seed(seed), device)
    return get_weights(model)


def config(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


def test_the_option_sets_the_switches_and_leaves_cpu_training_unchanged(restore_torch_flags):
    before = briggs_cnn_trained(torch.device("cpu"))
    Experiment(config("simulation.deterministic=true", "client.device=cpu")).client(0, 20)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    after = briggs_cnn_trained(torch.device("cpu"))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_conflicting_cublas_setting_is_a_config_error(restore_torch_flags, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError, match=r"simulation\.deterministic: .*CUBLAS_WORKSPACE_CONFIG=:4096:8 .* ':0:0'"):
        Experiment(config("simulation.deterministic=true")).client(0, 20)


@needs_cuda
def test_deterministic_cuda_training_repeats_bit_for_bit(restore_torch_flags):
    use_deterministic_kernels()
    first, second = briggs_cnn_trained(torch.device("cuda")), briggs_cnn_trained(torch.device("cuda"))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    different_seed = briggs_cnn_trained(torch.device("cuda"), seed=1)
    assert not np.array_equal(first[0], different_seed[0])


@needs_cuda
def test_cuda_training_follows_the_cpu_closely(restore_torch_flags):
    """Same seed, same batches on both devices: after one step the models differ only by float
    rounding (2.1e-5 at most on an H100; over many steps the differences grow, so CPU and GPU
    runs drift apart)."""
    use_deterministic_kernels()
    cpu, cuda = briggs_cnn_trained(torch.device("cpu"), samples=10), briggs_cnn_trained(torch.device("cuda"), samples=10)
    for a, b in zip(cpu, cuda, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
