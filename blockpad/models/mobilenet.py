"""MobileNetV2 as torchvision writes it (width 1.0): inverted residuals of a 1x1 expansion,
a 3x3 depthwise convolution (both with BN and ReLU6) and a linear 1x1 projection."""

from __future__ import annotations

import torch
from torch import nn


def _make_divisible(v, divisor=8):
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def conv_bn_act(c_in, c_out, k=3, stride=1, groups=1, act=nn.ReLU6):
    """torchvision's Conv2dNormActivation: conv (no bias, 'same' padding), BN, activation."""
    layers = [nn.Conv2d(c_in, c_out, k, stride, (k - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(c_out)]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, c_in, c_out, stride, expand_ratio):
        super().__init__()
        hidden = round(c_in * expand_ratio)
        self.use_res_connect = stride == 1 and c_in == c_out
        layers = [conv_bn_act(c_in, hidden, 1)] if expand_ratio != 1 else []
        layers += [conv_bn_act(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))       # expansion, channels, blocks, stride

    def __init__(self, num_classes=1000):
        super().__init__()
        c = _make_divisible(32)
        last = _make_divisible(1280)
        features = [conv_bn_act(3, c, stride=2)]
        for t, ch, n, s in self.SETTINGS:
            out = _make_divisible(ch)
            for i in range(n):
                features.append(InvertedResidual(c, out, s if i == 0 else 1, t))
                c = out
        features.append(conv_bn_act(c, last, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2():
    return MobileNetV2()
