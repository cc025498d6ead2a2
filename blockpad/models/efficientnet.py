"""EfficientNet-B0 as torchvision writes it: MBConv blocks (1x1 expansion, depthwise k x k,
squeeze-excitation, linear 1x1 projection) with SiLU, a residual where the shape allows
(stochastic depth is the identity at inference)."""

from __future__ import annotations

import torch
from torch import nn

from .mobilenet import _make_divisible, conv_bn_act


class SqueezeExcitation(nn.Module):
    def __init__(self, channels, squeeze):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation, self.scale_activation = nn.SiLU(), nn.Sigmoid()

    def forward(self, x):
        s = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return x * self.scale_activation(s)


class MBConv(nn.Module):
    def __init__(self, expand, kernel, stride, c_in, c_out):
        super().__init__()
        self.use_res_connect = stride == 1 and c_in == c_out
        hidden = _make_divisible(c_in * expand)
        layers = [conv_bn_act(c_in, hidden, 1, act=nn.SiLU)] if hidden != c_in else []
        layers += [conv_bn_act(hidden, hidden, kernel, stride, groups=hidden, act=nn.SiLU),
                   SqueezeExcitation(hidden, max(1, c_in // 4)),
                   conv_bn_act(hidden, c_out, 1, act=None)]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.block(x) if self.use_res_connect else self.block(x)


class EfficientNet(nn.Module):
    # expansion, kernel, stride, in, out, blocks (B0: width and depth 1.0)
    STAGES = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2),
              (6, 3, 2, 40, 80, 3), (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4),
              (6, 3, 1, 192, 320, 1))

    def __init__(self, num_classes=1000):
        super().__init__()
        features = [conv_bn_act(3, 32, 3, 2, act=nn.SiLU)]
        for expand, k, s, c_in, c_out, n in self.STAGES:
            features.append(nn.Sequential(*[MBConv(expand, k, s if i == 0 else 1,
                                                   c_in if i == 0 else c_out, c_out)
                                            for i in range(n)]))
        features.append(conv_bn_act(320, 1280, 1, act=nn.SiLU))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True),
                                        nn.Linear(1280, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0():
    return EfficientNet()
