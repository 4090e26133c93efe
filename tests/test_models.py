"""Model registry: shapes, parameter counts of the papers' networks, layer names used for
layer sharing, and the weight exchange helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcluster_flwr.models import MODELS, build_model, parameter_names
from fedcluster_flwr.training import get_weights, set_weights

DIGITS = (1, 8, 8)
MNIST = (1, 28, 28)
CIFAR = (3, 32, 32)

SUPPORTED = {
    "cnn_briggs": (DIGITS, MNIST, CIFAR),
    "lenet_cifar": (MNIST, CIFAR),
    "mlp_fmnist": (DIGITS, MNIST, CIFAR),
    "mlp3": (DIGITS, MNIST, CIFAR),
    "cnn_32_64_fc128": (DIGITS, MNIST, CIFAR),
    "cnn_zec_fmnist": (MNIST, CIFAR),
    "lenet_zec_cifar": (MNIST, CIFAR),
    "mlp_digits": (DIGITS, MNIST, CIFAR),
    "cnn_digits": (DIGITS, MNIST, CIFAR),
    "mlp_lin": (DIGITS, MNIST, CIFAR),
    "cnn_lin": (MNIST, CIFAR),
}

CASES = [(name, shape) for name, shapes in SUPPORTED.items() for shape in shapes]


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_every_registered_model_is_covered():
    assert set(SUPPORTED) == set(MODELS)


@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
@pytest.mark.parametrize("num_classes", [10, 62])
def test_model_returns_logits(name, shape, num_classes):
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes)
    x = torch.randn(5, *shape)
    logits = model(x)
    assert logits.shape == (5, num_classes)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.sum().backward()  # trainable end to end
    assert all(p.grad is not None for p in model.parameters())


def test_cnn_briggs_mnist_parameter_count():
    # McMahan et al.'s CNN: conv5x5 32, conv5x5 64 ("same" padding), 2x2 pools, FC 512, softmax 10
    model = build_model("cnn_briggs", MNIST, 10)
    assert num_parameters(model) == 1_663_370


def test_mlp_fmnist_parameter_count():
    model = build_model("mlp_fmnist", MNIST, 10)
    assert num_parameters(model) == 784 * 32 + 32 + 32 * 10 + 10


def test_mlp3_mnist_parameter_count():
    # McMahan et al.'s 2NN: 784-200-200-10
    model = build_model("mlp3", MNIST, 10)
    assert num_parameters(model) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


def test_lenet_cifar_parameter_count():
    # LeNet-5 on CIFAR-10: conv5x5 3->6, 6->16 (no padding), FC 400-120-84-10
    model = build_model("lenet_cifar", CIFAR, 10)
    expected = (3 * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    assert num_parameters(model) == expected


def test_the_dac_reference_codes_networks_have_its_shapes():
    """github.com/edvinli/DAC, main_fed.py: CNNFashion (conv 1->16 3x3, 16->32 3x3, no padding,
    2x2 pools, fc 32*5*5 -> 64 -> 10) and CNN (LeNet-5: conv 3->6 5x5, 6->16 5x5, fc 400-120-84-10)."""
    fmnist = build_model("cnn_zec_fmnist", MNIST, 10)
    shapes = {name: tuple(p.shape) for name, p in fmnist.named_parameters()}
    assert shapes == {
        "conv.0.weight": (16, 1, 3, 3), "conv.0.bias": (16,), "conv.1.weight": (32, 16, 3, 3), "conv.1.bias": (32,),
        "fc.0.weight": (64, 32 * 5 * 5), "fc.0.bias": (64,), "out.weight": (10, 64), "out.bias": (10,),
    }
    assert num_parameters(fmnist) == 160 + 4640 + 51264 + 650
    cifar = build_model("lenet_zec_cifar", CIFAR, 10)
    shapes = {name: tuple(p.shape) for name, p in cifar.named_parameters()}
    assert shapes["conv.0.weight"] == (6, 3, 5, 5) and shapes["conv.1.weight"] == (16, 6, 5, 5)
    assert shapes["fc.0.weight"] == (120, 16 * 5 * 5) and shapes["fc.1.weight"] == (84, 120) and shapes["out.weight"] == (10, 84)
    assert num_parameters(cifar) == num_parameters(build_model("lenet_cifar", CIFAR, 10))


def test_the_retired_cnn_dac_name_says_what_to_use_instead():
    from conftest import DEFAULT_CONFIG
    from fedcluster_flwr.config.load import load_config
    from fedcluster_flwr.declarations.schema import ConfigError

    with pytest.raises(ConfigError, match="model.name: 'cnn_dac' was renamed 'cnn_32_64_fc128' .* not Zec et al.'s CNN; "
                                          "for DAC use the reference code's 'cnn_zec_fmnist'"):
        load_config(DEFAULT_CONFIG, [("model.name", "cnn_dac")])


def test_lenet_cifar_rejects_too_small_inputs():
    with pytest.raises(ValueError, match="too small"):
        build_model("lenet_cifar", DIGITS, 10)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_names_have_sharing_prefixes(name):
    shape = SUPPORTED[name][-1]
    model = build_model(name, shape, 10)
    names = parameter_names(model)
    weights = get_weights(model)  # names line up with the exchanged arrays
    assert [tuple(model.get_parameter(n).shape) for n in names] == [w.shape for w in weights]
    assert all(n.split(".")[0] in ("conv", "fc", "out") for n in names), names
    if name.startswith(("cnn", "lenet")):
        assert any(n.startswith("conv") for n in names)
    assert names[-2:] == ["out.weight", "out.bias"]  # the classifier is the last layer


def test_get_weights_order_and_copies():
    model = build_model("cnn_digits", DIGITS, 10)
    weights = get_weights(model)
    state = model.state_dict()
    assert len(weights) == len(state)
    for array, (name, tensor) in zip(weights, state.items()):
        assert isinstance(array, np.ndarray) and array.dtype == np.float32
        np.testing.assert_array_equal(array, tensor.numpy(), err_msg=name)
    weights[0][...] = 123.0  # a copy: changing it does not touch the model
    assert not torch.any(model.state_dict()[parameter_names(model)[0]] == 123.0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_set_weights_round_trip(name):
    shape = SUPPORTED[name][-1]
    torch.manual_seed(1)
    source = build_model(name, shape, 10)
    torch.manual_seed(2)
    target = build_model(name, shape, 10)
    x = torch.randn(3, *shape)
    assert not torch.equal(source(x), target(x))
    set_weights(target, get_weights(source))
    for a, b in zip(get_weights(source), get_weights(target)):
        np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        assert torch.equal(source(x), target(x))


def test_set_weights_rejects_wrong_shape():
    model = build_model("mlp_digits", DIGITS, 10)
    before = get_weights(model)
    weights = get_weights(model)
    weights[0] = np.zeros((weights[0].shape[0] + 1, weights[0].shape[1]), dtype=np.float32)
    with pytest.raises(ValueError, match="expected shape"):
        set_weights(model, weights)
    for a, b in zip(before, get_weights(model)):  # the model is left unchanged
        np.testing.assert_array_equal(a, b)


def test_set_weights_rejects_wrong_count():
    model = build_model("mlp_digits", DIGITS, 10)
    with pytest.raises(ValueError, match="arrays"):
        set_weights(model, get_weights(model)[:-1])


def test_set_weights_from_other_model_size_fails():
    small = build_model("cnn_briggs", DIGITS, 10)
    large = build_model("cnn_briggs", MNIST, 10)
    with pytest.raises(ValueError):
        set_weights(small, get_weights(large))


def test_mlp_flattens_any_input_shape():
    model = build_model("mlp_digits", CIFAR, 10)
    first = model.state_dict()["fc.0.weight"]
    assert first.shape == (64, math.prod(CIFAR))


def test_lin_et_al_models_have_the_documented_layers():
    """Three fully connected layers (784-200-200-10); two 5x5 conv layers (10, 20) and FC 50."""
    mlp, cnn = build_model("mlp_lin", MNIST, 10), build_model("cnn_lin", MNIST, 10)
    assert [tuple(p.shape) for n, p in mlp.named_parameters() if n.endswith("weight")] == [(200, 784), (200, 200), (10, 200)]
    assert [tuple(p.shape) for n, p in cnn.named_parameters() if n.endswith("weight")] == [
        (10, 1, 5, 5), (20, 10, 5, 5), (50, 320), (10, 50)]
    assert (num_parameters(mlp), num_parameters(cnn)) == (199_210, 21_840)
