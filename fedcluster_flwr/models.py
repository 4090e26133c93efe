"""Model registry: the networks used by the reproduced papers, sized from the input shape.

Parameter names matter: LPS/GPS training shares layers by name prefix (e.g. ``conv``),
so convolutional layers are ``conv*``, hidden dense layers ``fc*`` and the classifier ``out``.

Each network also computes K clients' copies at once (``forward_stacked``), the batched engine's
step: parameters with a leading client axis, inputs ``[K, B, ...]``, logits ``[K, B, classes]``.
It is the same arithmetic as K calls of ``forward`` (a test checks it for every registered model),
shaped for the machine: a convolution over K clients is one grouped convolution with the client
axis in the channels, in channels-last memory (oneDNN's fast path on a CPU; cuDNN's on a GPU), and
a dense layer is one batched matrix product. A model without ``forward_stacked`` is stacked through
``torch.func.vmap`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from .declarations.schema import ConfigError

InputShape = tuple[int, int, int]  # (channels, height, width)


class MLP(nn.Module):
    """Fully connected network; ``hidden`` gives the hidden layer widths."""

    def __init__(self, input_shape: InputShape, num_classes: int, hidden: tuple[int, ...]):
        super().__init__()
        widths = (math.prod(input_shape), *hidden)
        self.fc = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.fc:
            x = torch.relu(layer(x))
        return self.out(x)

    def forward_stacked(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``forward`` of K models (``params[name]``: ``[K, *shape]``) on their own inputs ``x``:
        ``[K, B, C, H, W]`` -> ``[K, B, classes]``."""
        x = x.flatten(2)
        for i in range(len(self.fc)):
            x = torch.relu(stacked_linear(x, params[f"fc.{i}.weight"], params[f"fc.{i}.bias"]))
        return stacked_linear(x, params["out.weight"], params["out.bias"])


def stacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """K dense layers at once: ``x`` ``[K, B, in]``, ``weight`` ``[K, out, in]``, ``bias`` ``[K, out]``."""
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


class ConvNet(nn.Module):
    """Conv -> ReLU -> 2x2 max-pool blocks, then dense layers.

    ``padding = kernel // 2`` keeps spatial size through convolutions (TF "same"),
    as in McMahan et al.'s CNN that Briggs et al. use; ``padding = 0`` is LeNet's.

    The blocks compute max-pool before ReLU: ReLU is monotone, so relu(max(x)) = max(relu(x)) in
    every bit, and the gradients agree too (both reach the window's largest input, and only where
    it is positive); ReLU then runs on a quarter of the values.
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        channels: tuple[int, ...],
        hidden: tuple[int, ...],
        kernel: int,
        padding: int,
    ):
        super().__init__()
        self.padding = padding
        in_channels, height, width = input_shape
        convs = []
        for out_channels in channels:
            convs.append(nn.Conv2d(in_channels, out_channels, kernel, padding=padding))
            in_channels = out_channels
            height = (height + 2 * padding - kernel + 1) // 2
            width = (width + 2 * padding - kernel + 1) // 2
            if height < 1 or width < 1:
                raise ValueError(f"inputs of {input_shape[1]}x{input_shape[2]} pixels are too small")
        self.conv = nn.ModuleList(convs)
        widths = (in_channels * height * width, *hidden)
        self.fc = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.conv:
            x = torch.relu(nn.functional.max_pool2d(conv(x), 2))
        x = x.flatten(1)
        for layer in self.fc:
            x = torch.relu(layer(x))
        return self.out(x)

    def forward_stacked(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``forward`` of K models (``params[name]``: ``[K, *shape]``) on their own inputs ``x``:
        ``[K, B, C, H, W]`` -> ``[K, B, classes]``. The K convolutions are one convolution with
        ``groups=K`` over ``[B, K*C, H, W]`` in channels-last memory (group k sees only client k's
        channels), so the blocks never leave that layout; the features are put back in ``forward``'s
        (channel, row, column) order once, before the dense layers."""
        clients, batch, channels, height, width = x.shape
        # [K, B, C, H, W] -> [B, K*C, H, W] with channels-last strides (memory B, H, W, K, C), in one copy
        x = x.permute(1, 3, 4, 0, 2).contiguous().view(batch, height, width, clients * channels).permute(0, 3, 1, 2)
        for i in range(len(self.conv)):
            weight = params[f"conv.{i}.weight"]
            x = nn.functional.conv2d(
                x, weight.flatten(0, 1), params[f"conv.{i}.bias"].flatten(), padding=self.padding, groups=clients
            )
            x = torch.relu(nn.functional.max_pool2d(x, 2))
        per_client = x.shape[1] // clients
        height, width = x.shape[2], x.shape[3]
        # [B, K*C', H', W'] (memory B, H', W', K, C') -> [K, B, C'*H'*W'] in forward's flatten order
        x = x.permute(0, 2, 3, 1).reshape(batch, height, width, clients, per_client)
        x = x.permute(3, 0, 4, 1, 2).reshape(clients, batch, per_client * height * width)
        for i in range(len(self.fc)):
            x = torch.relu(stacked_linear(x, params[f"fc.{i}.weight"], params[f"fc.{i}.bias"]))
        return stacked_linear(x, params["out.weight"], params["out.bias"])


ModelFactory = Callable[[InputShape, int], nn.Module]

MODELS: dict[str, ModelFactory] = {
    # Briggs et al. / McMahan et al.: 2x conv5x5 (32, 64) + max-pool, FC 512 (1.66 M params on MNIST).
    "cnn_briggs": lambda s, c: ConvNet(s, c, channels=(32, 64), hidden=(512,), kernel=5, padding=2),
    # LeNet-5 for CIFAR-10: conv5x5 6, 16 + max-pool, FC 120, 84.
    "lenet_cifar": lambda s, c: ConvNet(s, c, channels=(6, 16), hidden=(120, 84), kernel=5, padding=0),
    # Ali & Arafa's Fashion-MNIST MLP: 784-32-10.
    "mlp_fmnist": lambda s, c: MLP(s, c, hidden=(32,)),
    # Three-layer MLP (McMahan et al.'s 2NN): 784-200-200-10.
    "mlp3": lambda s, c: MLP(s, c, hidden=(200, 200)),
    # A two-layer CNN of ours: conv3x3 32, 64 ("same" padding) + max-pool, FC 128. the CNN of the
    # practical multimodel confs (conf/multimodel_*_cnn.yaml); it was once (wrongly) called Zec et al.'s, see RENAMED.
    "cnn_32_64_fc128": lambda s, c: ConvNet(s, c, channels=(32, 64), hidden=(128,), kernel=3, padding=1),
    # The DAC reference code's (github.com/edvinli/DAC, main_fed.py) Fashion-MNIST CNN `CNNFashion`:
    # conv3x3 16, 32 without padding + max-pool (28 -> 26 -> 13 -> 11 -> 5), FC 64.
    "cnn_zec_fmnist": lambda s, c: ConvNet(s, c, channels=(16, 32), hidden=(64,), kernel=3, padding=0),
    # The DAC reference code's CIFAR-10 `CNN`: LeNet-5, conv5x5 6, 16 without padding + max-pool,
    # FC 120, 84 (its dropout layers are defined but never applied): the same network as lenet_cifar.
    "lenet_zec_cifar": lambda s, c: ConvNet(s, c, channels=(6, 16), hidden=(120, 84), kernel=5, padding=0),
    # Lin et al. (2023) name only the layer types, "three fully connected layers" (ReLU) and "two
    # convolutional layers and a fully connected layer"; the widths are ours: McMahan et al.'s 2NN
    # widths 784-200-200-10 (as mlp3), and PyTorch's MNIST-example CNN, conv5x5 10, 20 + max-pool, FC 50.
    "mlp_lin": lambda s, c: MLP(s, c, hidden=(200, 200)),
    "cnn_lin": lambda s, c: ConvNet(s, c, channels=(10, 20), hidden=(50,), kernel=5, padding=0),
    # Small models for scikit-learn's 8x8 digits.
    "mlp_digits": lambda s, c: MLP(s, c, hidden=(64,)),
    "cnn_digits": lambda s, c: ConvNet(s, c, channels=(16, 32), hidden=(64,), kernel=3, padding=1),
}


# Names that were given up, with what to use instead (a config naming one stops with this message).
RENAMED: dict[str, str] = {
    "cnn_dac": "was renamed 'cnn_32_64_fc128' (the same network: conv3x3 32/64 + FC 128), because it is not "
    "Zec et al.'s CNN; for DAC use the reference code's 'cnn_zec_fmnist' (Fashion-MNIST) or 'lenet_zec_cifar' (CIFAR-10)",
}


def build_model(name: str, input_shape: InputShape, num_classes: int) -> nn.Module:
    """Instantiate registry model ``name`` for inputs of ``input_shape`` (C, H, W)."""
    return MODELS[name](tuple(input_shape), num_classes)


def model_outline(name: str, input_shape: InputShape, num_classes: int) -> nn.Module:
    """Model ``name`` on the meta device: its layers, names and shapes without initialising any
    weight (config checks use it; no CPU kernel runs before ``simulation.portable_numerics`` pins them)."""
    with torch.device("meta"):
        return build_model(name, input_shape, num_classes)


def parameter_names(model: nn.Module) -> list[str]:
    """Names of the arrays exchanged with clients, in the order of :func:`get_weights`."""
    return list(model.state_dict().keys())


def parameters_with_prefixes(names: Sequence[str], prefixes: Sequence[str], key: str) -> list[int]:
    """Indices of the parameters named by ``prefixes`` (``conv`` names ``conv.0.weight``, ...).

    A prefix matches whole dotted components, so ``fc`` never names ``fc_extra``. A prefix
    that names no parameter is a config error on ``key`` listing the model's parameters.
    """
    for prefix in prefixes:
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            raise ConfigError(key, f"{prefix!r} names no parameter of the model; its parameters are: {', '.join(names)}")
    return [i for i, n in enumerate(names) if any(n == p or n.startswith(p + ".") for p in prefixes)]
