"""Reference networks in plain ``torch.nn``: torchvision's ResNet-18, ResNet-50, MobileNetV2,
EfficientNet-B0 and DenseNet-121 (layer for layer), and a channel-pruned ResNet-50, with seeded
random weights and batch-norm statistics (nothing is downloaded), exported to ONNX on demand.

torchvision's PyPI wheel is built against CUDA torch and fails to import next to the CPU wheel,
so the architectures are written out here. This package imports without PyTorch; making a
network needs it (``pip install torch==2.13.0``)."""

from __future__ import annotations

import importlib
import os

from blockpad.errors import BlockpadError

# name -> (module, constructor): imported on use, so `blockpad.models` needs no torch
NETWORKS = {
    "resnet18": ("resnet", "resnet18"),
    "resnet50": ("resnet", "resnet50"),
    "resnet50_pruned": ("resnet", "resnet50_pruned"),
    "mobilenet_v2": ("mobilenet", "mobilenet_v2"),
    "efficientnet_b0": ("efficientnet", "efficientnet_b0"),
    "densenet121": ("densenet", "densenet121"),
}
TORCH = "torch==2.13.0"


def _torch():
    try:
        import torch
    except ImportError:
        raise BlockpadError(f"blockpad.models needs PyTorch: pip install {TORCH}") from None
    return torch


def network(name: str, seed: int = 0):
    """The network ``name`` (see NETWORKS) in eval mode, with random weights and batch-norm
    statistics drawn from ``seed``."""
    if name not in NETWORKS:
        raise BlockpadError(f"network: expected one of {', '.join(NETWORKS)}; got {name!r}")
    torch = _torch()
    module, ctor = NETWORKS[name]
    make = getattr(importlib.import_module(f"{__name__}.{module}"), ctor)
    with torch.random.fork_rng():      # the pruned widths and the weights: from seed alone
        torch.manual_seed(seed)
        net = make(seed=seed) if name == "resnet50_pruned" else make()
        randomize(net, seed)
    return net.eval()


def randomize(net, seed: int = 0) -> None:
    """Fan-in scaled normal weights (activations keep their size through the depth, so the
    logits are neither 0 nor inf), small biases, and batch-norm statistics that are not the
    identity (scale 0.5-1.5, shift and mean +-0.1, variance 0.5-1.5): folding them into the
    convolutions is then a real computation."""
    torch = _torch()
    from torch import nn

    gen = torch.Generator().manual_seed(seed)

    def normal(t, std):
        t.copy_(torch.randn(t.shape, generator=gen) * std)

    def uniform(t, lo, hi):
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen))

    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fan_in = m.weight[0].numel()
                normal(m.weight, (2.0 / fan_in) ** 0.5 if isinstance(m, nn.Conv2d)
                       else fan_in ** -0.5)
                if m.bias is not None:
                    normal(m.bias, 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                uniform(m.weight, 0.5, 1.5)
                normal(m.bias, 0.1)
                normal(m.running_mean, 0.1)
                uniform(m.running_var, 0.5, 1.5)


def export_onnx(name: str, path, batch: int = 1, hw: int = 224, seed: int = 0, opset: int = 17):
    """Export network ``name`` for inputs ``(batch, 3, hw, hw)`` to the ONNX file ``path``
    (TorchScript exporter: the dynamo one needs onnxscript). Returns the torch module."""
    torch = _torch()
    net = network(name, seed)
    x = torch.zeros(batch, 3, hw, hw)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.onnx.export(net, (x,), os.fspath(path), input_names=["input"], output_names=["logits"],
                      opset_version=opset, dynamo=False)
    return net


def sample_input(batch: int = 1, hw: int = 224, seed: int = 1):
    """A seeded random image batch (float32 numpy, NCHW)."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal((batch, 3, hw, hw)).astype("float32")


__all__ = ["NETWORKS", "TORCH", "export_onnx", "network", "randomize", "sample_input"]
