"""DenseNet-121 as torchvision writes it: dense blocks whose layers (BN, ReLU, 1x1 conv, BN,
ReLU, 3x3 conv) each concatenate 32 new channels onto everything before them, joined by
transitions (BN, ReLU, 1x1 conv halving the channels, 2x2 average pooling). The channel
offsets of the concatenations are multiples of 32 plus 64, and the batch norms follow
concatenations, not convolutions."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class DenseLayer(nn.Module):
    def __init__(self, c_in, growth, bn_size):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(c_in), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(c_in, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features):
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers, c_in, growth, bn_size):
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(c_in + i * growth, growth, bn_size))

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.norm, self.relu = nn.BatchNorm2d(c_in), nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)


class DenseNet(nn.Module):
    def __init__(self, growth=32, blocks=(6, 12, 24, 16), init=64, bn_size=4, num_classes=1000):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, init, 7, 2, 3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(init))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(3, 2, 1))
        c = init
        for i, n in enumerate(blocks):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i != len(blocks) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(c, c // 2))
                c //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(c))
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(F.relu(self.features(x)), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def densenet121():
    return DenseNet()
