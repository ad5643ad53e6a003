"""Wide residual networks (Zagoruyko & Komodakis, 2016), the vision model of low-rank training (seed 004).

WRN-d-k for CIFAR-size images: a 3×3 stem conv to 16 channels, three groups of n = (d − 4) / 6
pre-activation basic blocks (BN → ReLU → 3×3 conv → BN → ReLU → dropout → 3×3 conv, plus a 1×1
conv shortcut where the shape changes) of widths 16k, 32k, 64k with strides 1, 2, 2, then BN → ReLU →
global average pool → linear. The seed factorises every conv but the first (the stem):
`factorize(model, rank)` with the default 'vision' preset does exactly that.

Registered: `wrn_28_10` (CIFAR-100, 36.5M parameters), `wrn_16_4` (CIFAR-10), `wrn_16_2_mnist` and
`wrn_10_2_digits` (small, for the data that ships here). `depth` and `widen_factor` are arguments of
every variant. `forward_features` returns the final map [B, C, H, W], as timm's CNNs do (timm's
`forward_head`, pooling and feature tools expect NCHW from a convolutional network).
"""
from typing import List, Optional, Union

import torch
from timm.layers import DropPath
from timm.models import generate_default_cfgs
from timm.models._features import feature_take_indices
from torch import nn

from ..functional.tracing import checked_images
from ._registry import register_model
from ..arguments import count, image_size, positive_int, rate
from .base import CIFAR10_CFG, DIGITS_CFG, MNIST_CFG, StructuredModel, create_model, model_cfg

__all__ = ['WideResNet', 'WideBasicBlock']

torch.fx.wrap('checked_images')                 # the input check is one node of an FX trace (functional/tracing.py)


class WideBasicBlock(nn.Module):
    """Pre-activation basic block: x + conv(relu(bn(conv(relu(bn(x)))))), 1×1 shortcut on shape change."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, drop_rate: float = 0.0, drop_path: float = 0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_chs)
        self.conv1 = nn.Conv2d(in_chs, out_chs, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_chs)
        self.drop = nn.Dropout(drop_rate)
        self.conv2 = nn.Conv2d(out_chs, out_chs, 3, stride=1, padding=1, bias=False)
        self.shortcut = (nn.Conv2d(in_chs, out_chs, 1, stride=stride, bias=False)
                         if stride != 1 or in_chs != out_chs else None)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()     # stochastic depth (timm's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.drop(torch.relu(self.bn2(out))))
        return self.drop_path(out) + skip


class WideResNet(StructuredModel):
    """WRN-`depth`-`widen_factor` (see the module docstring)."""
    feature_modules = 'stages'
    num_prefix_tokens = 0

    def __init__(self, depth: int = 28, widen_factor: int = 10, num_classes: int = 100, in_chans: int = 3,
                 drop_rate: float = 0.0, drop_path_rate: float = 0.0, global_pool: str = 'avg',
                 img_size: Optional[int] = None):
        super().__init__()
        if not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
            raise ValueError(f"depth={depth!r}: a WRN depth is 6n + 4 with n >= 1 (10, 16, 22, 28, 40, ...)")
        positive_int('widen_factor', widen_factor)
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool={global_pool!r}: accepted 'avg' or ''")
        rate('drop_rate', drop_rate)                    # torch's dropout named no argument
        rate('drop_path_rate', drop_path_rate)
        positive_int('in_chans', in_chans)              # -1 failed inside the stem convolution
        count('num_classes', num_classes)
        if img_size is not None:
            image_size('img_size', img_size)
        n = (depth - 4) // 6
        # timm's rule: the drop-path rate grows linearly from 0 at the first block to drop_path_rate at the last
        rates = [drop_path_rate * i / max(3 * n - 1, 1) for i in range(3 * n)]
        widths = [16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.in_chans, self.num_classes, self.global_pool = in_chans, num_classes, global_pool
        self.img_size = img_size                      # any size works; recorded for the data facts only
        self.declare_fixed_input_size(False)
        self.stem = nn.Conv2d(in_chans, 16, 3, padding=1, bias=False)
        self.stages = nn.ModuleList()
        in_chs = 16
        for i, width in enumerate(widths):
            blocks = [WideBasicBlock(in_chs if j == 0 else width, width, (1 if i == 0 else 2) if j == 0 else 1,
                                     drop_rate, rates[i * n + j]) for j in range(n)]
            self.stages.append(nn.Sequential(*blocks))
            in_chs = width
        self.norm = nn.Sequential(nn.BatchNorm2d(in_chs), nn.ReLU())
        self.num_features = self.head_hidden_size = in_chs
        self.head = nn.Linear(in_chs, num_classes) if num_classes > 0 else nn.Identity()
        # `module`: the stage's last block, whose output is the stage's (timm's hook extractor hooks it; the stage
        # itself is never called, blocks run one by one through run_block, so hooking 'stages.i' gave nothing)
        self.feature_info = [dict(num_chs=w, reduction=2 ** i, module=f'stages.{i}.{len(stage) - 1}')
                             for i, (w, stage) in enumerate(zip(widths, self.stages))]
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            if global_pool not in ('avg', ''):
                raise ValueError(f"global_pool={global_pool!r}: accepted 'avg' or ''")
            self.global_pool = global_pool
        self.head = nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        return checked_images(x, 'WideResNet', self.in_chans)          # an FX leaf: traceable

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False):
        """timm's feature interface: the outputs of the groups in `indices` (None: all three) as maps
        [B, C_i, H_i, W_i] ('NCHW') or tokens ('NLC'); `norm` applies the final BN-ReLU to the last. The
        final map is forward_features' (after BN-ReLU), or the last group run's when `stop_early` stops sooner."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt={output_fmt!r}: accepted 'NCHW' or 'NLC'")
        x = self._check_input(x)
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        x = self.stem(x)
        last = len(self.stages) - 1
        intermediates = []
        for i in range(max_index + 1 if stop_early else len(self.stages)):
            x = self._run_stage(self.stages[i], x)
            if i in take_indices:
                out = self.norm(x) if norm and i == last else x
                intermediates.append(out.flatten(2).transpose(1, 2) if output_fmt == 'NLC' else out)
        if intermediates_only:
            return intermediates
        # the final BN-ReLU has the last group's width: stopped early, the map stays as it is (timm's
        # EfficientNet applies its head conv / norm only when the last stage ran)
        return (self.norm(x) if i == last else x), intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The final map after BN-ReLU, [B, C, H, W] (NCHW, as timm's CNNs)."""
        x = self._check_input(x)
        x = self.stem(x)
        for stage in self.stages:
            x = self._run_stage(stage, x)
        return self.norm(x)

    def _run_stage(self, stage: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        """Block by block through `run_block`, so `set_grad_checkpointing()` recomputes each block in backward
        (as timm's ResNets do; the recomputation leaves BatchNorm's running statistics as the forward left them)."""
        for block in stage:
            x = self.run_block(block, x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Features [B, C, H, W] -> 'avg': pooled [B, C] (logits [B, classes]); '': the unpooled map
        [B, C, H, W] as timm's ResNets return it (the head, if any, applied at every position)."""
        if self.global_pool == 'avg':
            x = x.mean(dim=(2, 3))
            return x if pre_logits else self.head(x)
        if pre_logits:
            return x
        return self.head(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _cfg(**kwargs):
    return model_cfg(**dict(dict(first_conv='stem', mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
                                 crop_pct=1.0), **kwargs))


default_cfgs = generate_default_cfgs({
    'wrn_28_10.untrained': _cfg(num_classes=100, input_size=(3, 32, 32)),
    'wrn_16_4.untrained': _cfg(num_classes=10, input_size=(3, 32, 32), **CIFAR10_CFG),
    'wrn_16_2_mnist.untrained': _cfg(num_classes=10, input_size=(1, 28, 28), **MNIST_CFG),
    'wrn_10_2_digits.untrained': _cfg(num_classes=10, input_size=(1, 8, 8), **DIGITS_CFG),
})


def _create(variant: str, pretrained: bool = False, **kwargs) -> WideResNet:
    return create_model(WideResNet, variant, pretrained, default_out_indices=3, **kwargs)


@register_model
def wrn_28_10(pretrained: bool = False, **kwargs) -> WideResNet:
    """WRN-28-10 (the seed's CIFAR-100 model, Table 2)."""
    return _create('wrn_28_10', pretrained, **dict(dict(depth=28, widen_factor=10, num_classes=100), **kwargs))


@register_model
def wrn_16_4(pretrained: bool = False, **kwargs) -> WideResNet:
    """WRN-16-4 for CIFAR-10-size images."""
    return _create('wrn_16_4', pretrained, **dict(dict(depth=16, widen_factor=4, num_classes=10), **kwargs))


@register_model
def wrn_16_2_mnist(pretrained: bool = False, **kwargs) -> WideResNet:
    """WRN-16-2 on 28×28 grayscale (MNIST)."""
    return _create('wrn_16_2_mnist', pretrained,
                   **dict(dict(depth=16, widen_factor=2, num_classes=10, in_chans=1), **kwargs))


@register_model
def wrn_10_2_digits(pretrained: bool = False, **kwargs) -> WideResNet:
    """WRN-10-2 on 8×8 grayscale (sklearn digits)."""
    return _create('wrn_10_2_digits', pretrained,
                   **dict(dict(depth=10, widen_factor=2, num_classes=10, in_chans=1), **kwargs))
