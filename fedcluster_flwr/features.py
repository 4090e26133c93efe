"""Feature maps Φ and the Gram-matrix eigenvectors of one-shot data-similarity clustering
(Ali & Arafa): each client summarises its data by the top-k eigenvectors of G = (1/n) ΦᵀΦ.

Φ is pluggable (``strategy.features``):

* ``identity``: the flattened, standardised images as the client's model sees them
  (normalised with the dataset's mean and std); d = C·H·W.
* ``random_projection``: identity followed by a Gaussian projection to ``feature_dim``
  dimensions, drawn from ``feature_seed``, so every client uses the same projection.
* ``pretrained``: the pooled features of a torchvision ResNet-18 whose weights file
  (``pretrained_weights``) must already be on disk; nothing is downloaded. d = 512.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch

from .declarations.schema import ConfigError

FEATURES = ("identity", "random_projection", "pretrained")
PRETRAINED_DIM = 512  # ResNet-18's pooled features

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def feature_dim(features: str, input_shape: tuple[int, ...], projected_dim: int | None) -> int:
    """d, the number of features of Φ."""
    if features == "identity":
        return math.prod(input_shape)
    if features == "random_projection":
        if projected_dim is None:
            raise ConfigError("strategy.feature_dim", "is required for features random_projection")
        return projected_dim
    return PRETRAINED_DIM


def feature_map(
    features: str, input_shape: tuple[int, ...], dim: int, seed: int, weights: str | None = None
) -> FeatureMap:
    """Φ: a batch of images (n, C, H, W) -> features (n, d), float64."""
    if features == "identity":
        return lambda x: x.flatten(1).double()
    if features == "random_projection":
        projection = _projection(math.prod(input_shape), dim, seed)
        return lambda x: x.flatten(1).double() @ projection
    if features == "pretrained":
        backbone = _resnet18(str(weights))
        return lambda x: _pooled_features(backbone, x)
    raise ConfigError("strategy.features", f"expected one of {', '.join(FEATURES)}, got {features!r}")


@functools.lru_cache(maxsize=4)
def _projection(input_dim: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(input_dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)


# torchvision's ImageNet ResNet-18 (ResNet18_Weights.IMAGENET1K_V1), the backbone Ali & Arafa's CIFAR-10
# experiment takes its features from; torchvision itself keeps it under ~/.cache/torch/hub/checkpoints/.
RESNET18_FILE = "resnet18-f37072fd.pth"
RESNET18_URL = f"https://download.pytorch.org/models/{RESNET18_FILE}"


def check_weights_file(weights: str | None, key: str = "strategy.pretrained_weights") -> Path:
    """The pretrained backbone's weights file, which must exist (this project never downloads);
    ``key`` is the option that names it, for the error."""
    if not weights:
        raise ConfigError(
            key,
            f"features 'pretrained' needs the path of torchvision's ImageNet ResNet-18 weights ({RESNET18_FILE}, "
            f"from {RESNET18_URL}); nothing is downloaded",
        )
    path = Path(weights).expanduser()
    if not path.is_file():
        raise ConfigError(
            key,
            f"expected the ImageNet ResNet-18 weights at {path}, which does not exist: download torchvision's "
            f"{RESNET18_FILE} from {RESNET18_URL} and put it there (or set {key} to where it is)",
        )
    return path


@functools.lru_cache(maxsize=2)
def _resnet18(weights: str) -> torch.nn.Module:
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    model.load_state_dict(torch.load(check_weights_file(weights), map_location="cpu", weights_only=True))
    model.fc = torch.nn.Identity()
    return model.eval()


@torch.no_grad()
def _pooled_features(backbone: torch.nn.Module, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)  # grey images fill the three input channels
    if min(x.shape[2:]) < 32:
        x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return torch.cat([backbone(x[i : i + batch]) for i in range(0, len(x), batch)]).double()


def gram_matrix(phi: torch.Tensor) -> torch.Tensor:
    """G = (1/n) ΦᵀΦ (d × d, float64): the second moment of the client's features."""
    return phi.T @ phi / max(len(phi), 1)


def top_eigenpairs(gram: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest eigenvalues of the symmetric ``gram`` (descending) and their unit
    eigenvectors as rows (k × d). Tiny negative eigenvalues from round-off are set to 0."""
    values, vectors = torch.linalg.eigh(gram)  # ascending
    order = torch.argsort(values, descending=True)[:k]
    return vectors[:, order].T.contiguous(), values[order].clamp_min(0.0)
