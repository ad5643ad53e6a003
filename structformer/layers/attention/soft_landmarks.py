"""SOFT's conv landmark sampler (§3.2): the m bottleneck tokens Q̃ as a k×k, stride-k convolution over the H×W grid
of Q, run as one matmul over flattened non-overlapping windows, with `F.conv2d` kept as its reference
(`forward_reference`). Border windows of a grid k does not divide see replicate padding, never zeros (`border=
'replicate'`), or, as the public code's unpadded Conv2d, the rows and columns past the last whole window are
dropped (`border='drop'`, SOFT's `official` option `landmark_border`). The weight's
k is known from `sampling_ratio` or the grid; otherwise it is a lazy parameter created at the first forward.
Used by `soft.SoftAttention` (sampler='conv', the default)."""
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from ..lazy import drop_lazy_hooks, is_uninitialized

SAMPLER_INITS = ('avgpool', 'kaiming')
BORDERS = ('replicate', 'drop')          # a grid k does not divide: pad the last windows, or drop what they miss


def sampling_ratio_for(height: int, width: int, num_landmarks: int) -> int:
    """k = ⌈√(HW / num_landmarks)⌉: the smallest pooling ratio whose ⌈H/k⌉·⌈W/k⌉ grid is ≈ num_landmarks."""
    return max(1, math.ceil(math.sqrt(height * width / num_landmarks)))


class ConvLandmarkSampler(LazyModuleMixin, nn.Module):
    """Conv2d with kernel = stride = k over the token grid (SOFT §3.2), initialised as average pooling.

    The weight is stored channels-last, [C_out, k, k, C_in] (`F.conv2d`'s layout is
    `weight.permute(0, 3, 1, 2)`), because tokens are channels-last: a flattened k×k window of tokens
    is then ordered like a weight row, and the matmul reads the weight as a free view instead of
    rearranging it on every forward (and its gradient on every backward).
    With `kernel_size=None` the k×k weight is created at the first call from the k passed then.
    """

    def __init__(self, channels: int, kernel_size: Optional[int] = None, device=None, dtype=None,
                 init: str = 'avgpool', border: str = 'replicate'):
        super().__init__()
        if init not in SAMPLER_INITS:
            raise ValueError(f"sampler_init must be one of {SAMPLER_INITS}, got {init!r}")
        if border not in BORDERS:
            raise ValueError(f"landmark_border must be one of {BORDERS}, got {border!r}")
        self.channels = channels
        self.init = init
        self.border = border
        if kernel_size is None:
            self.weight = nn.UninitializedParameter(device=device, dtype=dtype)
        else:
            self.weight = nn.Parameter(torch.empty(channels, kernel_size, kernel_size, channels,
                                                   device=device, dtype=dtype))
            self.reset_parameters()
            drop_lazy_hooks(self)

    @property
    def kernel_size(self) -> Optional[int]:
        return None if is_uninitialized(self.weight) else self.weight.shape[1]

    def reset_parameters(self) -> None:
        if self.has_uninitialized_params():
            return
        k = self.kernel_size
        if self.init == 'kaiming':
            # nn.Conv2d's default (the public code's): fan_in = C·k·k in either weight layout
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            return
        eye = torch.eye(self.channels, dtype=self.weight.dtype, device=self.weight.device)
        with torch.no_grad():
            # identity over channels, uniform over the window = average pooling
            self.weight.copy_(eye[:, None, None, :].expand_as(self.weight) / (k * k))

    def initialize_parameters(self, tokens: torch.Tensor, grid_size: Tuple[int, int],
                              kernel_size: Optional[int] = None) -> None:
        """Create the k×k weight (the owning attention calls this with its k before the first forward;
        LazyModuleMixin's own pre-forward call, which cannot know k, is then a no-op)."""
        if not self.has_uninitialized_params():
            return
        if kernel_size is None:
            raise RuntimeError("ConvLandmarkSampler: kernel_size must be given before the first forward")
        with torch.no_grad():
            self.weight.materialize((self.channels, kernel_size, kernel_size, self.channels), device=tokens.device)
        self.reset_parameters()
        drop_lazy_hooks(self)
        warnings.warn(f"SOFT conv sampler: k={kernel_size} weights created at the first forward; build the "
                      "optimizer after one forward pass, or pass sampling_ratio= or grid_size= at construction")

    def forward(self, tokens: torch.Tensor, grid_size: Tuple[int, int]) -> torch.Tensor:
        """Landmarks [..., m, C] from grid tokens [..., H·W, C] (row-major grid), m = ⌈H/k⌉·⌈W/k⌉ (⌊H/k⌋·⌊W/k⌋
        with border='drop').

        Kernel = stride = k, so the windows do not overlap and the conv is one matmul: each k×k
        window flattened to k²C values, times the weight viewed as [C, k²C]. This skips the
        [B, C, H, W] layout copy and the generic convolution that `forward_reference` pays.
        """
        k = self.kernel_size                                       # fixed once built
        h, w = grid_size
        lead = tokens.shape[:-2]
        if self.border == 'drop' and (h % k or w % k):             # the public unpadded conv: whole windows only
            tokens, h, w = self._whole_windows(tokens, h, w)
        if -h % k or -w % k:                                       # replicate-pad to whole windows
            planes = rearrange(tokens, '... (y x) c -> (...) c y x', y=h, x=w)
            planes = F.pad(planes, (0, -w % k, 0, -h % k), mode='replicate')
            tokens, h, w = rearrange(planes, 'b c y x -> b (y x) c'), planes.shape[-2], planes.shape[-1]
        windows = rearrange(tokens, '... (gy ky gx kx) c -> ... (gy gx) (ky kx c)', ky=k, kx=k, gy=h // k, gx=w // k)
        weight = self.weight.reshape(self.channels, -1)          # (ky kx c) rows: a view, no copy
        # no -1 in the shape: a batch may be empty
        return (windows @ weight.t()).reshape(*lead, windows.shape[-2], self.channels)

    def _whole_windows(self, tokens: torch.Tensor, h: int, w: int):
        """The grid cut to its whole k×k windows (`border='drop'`): tokens [..., H·W, C] -> [..., H'·W', C]."""
        k = self.kernel_size
        if h < k or w < k:
            raise ValueError(f"landmark_border='drop' needs a token grid of at least k×k = {k}×{k}, got {h}×{w}; "
                             "use landmark_border='replicate' (pads the border windows)")
        grid = rearrange(tokens, '... (y x) c -> ... y x c', y=h, x=w)[..., :h - h % k, :w - w % k, :]
        return grid.flatten(-3, -2), h - h % k, w - w % k

    def forward_reference(self, tokens: torch.Tensor, grid_size: Tuple[int, int]) -> torch.Tensor:
        """The same map as `forward`, written as padding + `F.conv2d` on [B, C, H, W] planes (with `border='drop'`:
        `F.conv2d` unpadded, as the public code's Conv2d). For tests."""
        k = self.kernel_size
        h, w = grid_size
        planes = rearrange(tokens, '... (y x) c -> (...) c y x', y=h, x=w)
        if self.border == 'drop':
            pooled = F.conv2d(planes, self.weight.permute(0, 3, 1, 2), stride=k)
            landmarks = rearrange(pooled, 'b c y x -> b (y x) c')
            return landmarks.reshape(*tokens.shape[:-2], landmarks.shape[-2], self.channels)
        planes = F.pad(planes, (0, -w % k, 0, -h % k), mode='replicate')
        pooled = F.conv2d(planes, self.weight.permute(0, 3, 1, 2), stride=k)
        landmarks = rearrange(pooled, 'b c y x -> b (y x) c')
        return landmarks.reshape(*tokens.shape[:-2], landmarks.shape[-2], self.channels)

    def extra_repr(self) -> str:
        border = '' if self.border == 'replicate' else f", border={self.border!r}"
        return f"channels={self.channels}, kernel_size=stride={self.kernel_size}{border}"
