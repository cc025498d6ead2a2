"""ResNet-18 and ResNet-50 as torchvision writes them (v1.5: a bottleneck strides in its 3x3
convolution), and a channel-pruned ResNet-50.

The pruned network cuts every convolution's output channels to a seeded random 60-90%, the way
structured pruning leaves real models: the convolutions whose outputs a residual add joins
(each stage's last 1x1 convolutions and its downsample) keep one width per stage, every other
convolution its own. Almost no width is then a multiple of 8 or 16.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv(c_in, c_out, k, stride=1, groups=1):
    return nn.Conv2d(c_in, c_out, k, stride, (k - 1) // 2, groups=groups, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in, width, stride=1, downsample=None, widths=None):
        super().__init__()
        mid, out = widths or (width, width)
        self.conv1, self.bn1 = _conv(c_in, mid, 3, stride), nn.BatchNorm2d(mid)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv(mid, out, 3), nn.BatchNorm2d(out)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in, width, stride=1, downsample=None, widths=None):
        super().__init__()
        mid1, mid2, out = widths or (width, width, width * self.expansion)
        self.conv1, self.bn1 = _conv(c_in, mid1, 1), nn.BatchNorm2d(mid1)
        self.conv2, self.bn2 = _conv(mid1, mid2, 3, stride), nn.BatchNorm2d(mid2)
        self.conv3, self.bn3 = _conv(mid2, out, 1), nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet. ``prune``: a function ``(channels) -> kept channels`` applied to
    every convolution's output (None: the full network)."""

    def __init__(self, block, layers, num_classes=1000, prune=None):
        super().__init__()
        keep = prune or (lambda c: c)
        self.inplanes = keep(64)
        self.conv1 = nn.Conv2d(3, self.inplanes, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        for i, n in enumerate(layers):
            stages.append(self._make_layer(block, 64 << i, n, 1 if i == 0 else 2, keep))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, num_classes)

    def _make_layer(self, block, width, blocks, stride, keep):
        out = keep(width * block.expansion)      # one width for every output a residual joins
        inner = 2 if block is Bottleneck else 1

        def widths():
            return tuple(keep(width) for _ in range(inner)) + (out,)

        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(_conv(self.inplanes, out, 1, stride), nn.BatchNorm2d(out))
        layers = [block(self.inplanes, width, stride, downsample, widths())]
        self.inplanes = out
        layers += [block(out, width, widths=widths()) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18():
    return ResNet(BasicBlock, [2, 2, 2, 2])


def resnet50():
    return ResNet(Bottleneck, [3, 4, 6, 3])


def resnet50_pruned(seed=0):
    """ResNet-50 with every convolution's output channels cut to a seeded random 60-90%."""
    gen = torch.Generator().manual_seed(seed)

    def keep(c):
        frac = 0.6 + 0.3 * torch.rand((), generator=gen).item()
        return max(1, round(c * frac))

    return ResNet(Bottleneck, [3, 4, 6, 3], prune=keep)
