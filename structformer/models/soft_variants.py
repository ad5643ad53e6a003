"""The registered SOFT / SOFT++ models (timm names, `timm.create_model`): Table 1's four sizes, the public code's
configurations (`*_official_224`, `official=True`; docs/soft.md lists every difference), the Table 2 baselines on
the Tiny backbone, and the small-image settings (MNIST 28 px, the embedded 8×8 digits). The network itself:
`structformer.models.soft.SoftNet`."""
from timm.models import generate_default_cfgs

from ._registry import register_model
from .base import DIGITS_CFG, MNIST_CFG, create_model, model_cfg
from .soft import SoftNet

def _cfg(**kwargs):
    return model_cfg(first_conv='stages.0.downsample.0.0', **kwargs)


_DIGITS = dict(num_classes=10, input_size=(1, 8, 8), **DIGITS_CFG)
_MNIST = dict(num_classes=10, input_size=(1, 28, 28), **MNIST_CFG)

# Table 1 of SOFT
_SIZES = {
    'tiny': dict(dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(2, 2, 5, 2)),
    'small': dict(dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24), depths=(2, 2, 5, 2)),
    'medium': dict(dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24), depths=(2, 2, 18, 2)),
    'large': dict(dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32), depths=(2, 2, 18, 2)),
}
# The public code's configurations (fudan-zvg/SOFT, models/softmax_free_vision_transformer.py); with
# official=True: post-LN SOFT stages 1–3, softmax stage 4, position embeddings, conv biases, MLP ratio 4
# everywhere (its `mlp_ratios=[8, 8, 4, 4]` never reaches the SOFT blocks, whose hidden width is 4·dim,
# and stage 4 reads mlp_ratios[3] = 4).
_OFFICIAL_SIZES = {
    'tiny': dict(dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(1, 2, 3, 2)),
    'small': dict(dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(1, 3, 20, 4)),
    'medium': dict(dims=(64, 128, 288, 512), num_heads=(2, 4, 9, 16), depths=(1, 3, 29, 5)),
    'large': dict(dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(1, 3, 40, 5)),
    # the public README's SOFT-Huge (87M, 83.3 %) and SOFT-Huge-Norm: not in Table 1, only in the public code
    'huge': dict(dims=(64, 128, 352, 512), num_heads=(2, 4, 11, 16), depths=(1, 5, 49, 5)),
}
# Table 2 baselines on the Tiny backbone
BASELINES = ('softmax', 'linformer', 'performer', 'nystrom')
# Small-image setting: stem ÷2 (strides 2, 1, 1) so 28 px gives grids 14², 7², 4², 2²; sp (4, 3, 2, 2)
# then gives m = 16, 9, 4, 1 landmarks (the stage-4 cls token is one more landmark for SOFT).
_MNIST_ARGS = dict(img_size=28, in_chans=1, num_classes=10, stem_strides=(2, 1, 1), sampling_ratios=(4, 3, 2, 2))

# Embedded-data setting (scikit-learn digits, 8×8): no stem striding, so the stage grids are 8², 4², 2², 1²;
# sp (2, 2, 1, 1) gives m = 16, 4, 4, 1 landmarks (stage 3's 2×2 grid is its own landmark set, exact there).
# Narrow and shallow (Tiny's head width 32 and FFN ratio, depths 1/1/2/1) so it trains in seconds on a CPU.
_DIGITS_ARGS = dict(img_size=8, in_chans=1, num_classes=10, dims=(32, 64, 96, 128), num_heads=(1, 2, 3, 4),
                    depths=(1, 1, 2, 1), stem_strides=(1, 1, 1), sampling_ratios=(2, 2, 1, 1))

_NAMES = ([f'{family}_{size}_224' for size in _SIZES for family in ('soft', 'softpp')]
          + [f'soft_tiny_{attn}_224' for attn in BASELINES]
          + ['soft_tiny_mnist', 'softpp_tiny_mnist'] + [f'soft_tiny_{attn}_mnist' for attn in BASELINES]
          + ['soft_digits', 'softpp_digits']
          + [f'{family}_{size}_official_224' for size in _OFFICIAL_SIZES for family in ('soft', 'softpp')])

# fixed_input_size: the public code's position embeddings and Linformer's projections are made for one token count
# (the registered defaults; a model built with other options says its own in timm's traits, SoftNet.__init__)
default_cfgs = generate_default_cfgs({f'{name}.untrained': dict(
    _cfg(**_MNIST) if name.endswith('_mnist') else _cfg(**_DIGITS) if name.endswith('_digits') else _cfg(),
    fixed_input_size='official' in name or 'linformer' in name) for name in _NAMES})


def _create(variant: str, pretrained: bool = False, **kwargs) -> SoftNet:
    return create_model(SoftNet, variant, pretrained, default_out_indices=4, **kwargs)


@register_model
def soft_tiny_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Tiny (Table 1)."""
    return _create('soft_tiny_224', pretrained, **dict(dict(_SIZES['tiny'], attn='soft'), **kwargs))


@register_model
def softpp_tiny_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Tiny (Table 1, Eq. 17 normalisation)."""
    return _create('softpp_tiny_224', pretrained, **dict(dict(_SIZES['tiny'], attn='softpp'), **kwargs))


@register_model
def soft_small_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Small (Table 1)."""
    return _create('soft_small_224', pretrained, **dict(dict(_SIZES['small'], attn='soft'), **kwargs))


@register_model
def softpp_small_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Small (Table 1, Eq. 17 normalisation)."""
    return _create('softpp_small_224', pretrained, **dict(dict(_SIZES['small'], attn='softpp'), **kwargs))


@register_model
def soft_medium_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Medium (Table 1)."""
    return _create('soft_medium_224', pretrained, **dict(dict(_SIZES['medium'], attn='soft'), **kwargs))


@register_model
def softpp_medium_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Medium (Table 1, Eq. 17 normalisation)."""
    return _create('softpp_medium_224', pretrained, **dict(dict(_SIZES['medium'], attn='softpp'), **kwargs))


@register_model
def soft_large_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Large (Table 1)."""
    return _create('soft_large_224', pretrained, **dict(dict(_SIZES['large'], attn='soft'), **kwargs))


@register_model
def softpp_large_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Large (Table 1, Eq. 17 normalisation)."""
    return _create('softpp_large_224', pretrained, **dict(dict(_SIZES['large'], attn='softpp'), **kwargs))


@register_model
def soft_tiny_softmax_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """Table 2: the Tiny backbone with softmax attention."""
    return _create('soft_tiny_softmax_224', pretrained, **dict(dict(_SIZES['tiny'], attn='softmax'), **kwargs))


@register_model
def soft_tiny_linformer_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """Table 2: the Tiny backbone with linformer attention."""
    return _create('soft_tiny_linformer_224', pretrained, **dict(dict(_SIZES['tiny'], attn='linformer'), **kwargs))


@register_model
def soft_tiny_performer_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """Table 2: the Tiny backbone with performer attention."""
    return _create('soft_tiny_performer_224', pretrained, **dict(dict(_SIZES['tiny'], attn='performer'), **kwargs))


@register_model
def soft_tiny_nystrom_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """Table 2: the Tiny backbone with nystrom attention."""
    return _create('soft_tiny_nystrom_224', pretrained, **dict(dict(_SIZES['tiny'], attn='nystrom'), **kwargs))


@register_model
def soft_tiny_mnist(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Tiny on 28×28 MNIST."""
    return _create('soft_tiny_mnist', pretrained, **dict(dict(_SIZES['tiny'], attn='soft', **_MNIST_ARGS), **kwargs))


@register_model
def softpp_tiny_mnist(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Tiny on 28×28 MNIST."""
    return _create('softpp_tiny_mnist', pretrained, **dict(dict(_SIZES['tiny'], attn='softpp', **_MNIST_ARGS), **kwargs))


@register_model
def soft_tiny_softmax_mnist(pretrained: bool = False, **kwargs) -> SoftNet:
    """The Tiny backbone with softmax attention on 28×28 MNIST."""
    return _create('soft_tiny_softmax_mnist', pretrained, **dict(dict(_SIZES['tiny'], attn='softmax', **_MNIST_ARGS), **kwargs))


@register_model
def soft_tiny_linformer_mnist(pretrained: bool = False, **kwargs) -> SoftNet:
    """The Tiny backbone with linformer attention on 28×28 MNIST."""
    return _create('soft_tiny_linformer_mnist', pretrained, **dict(dict(_SIZES['tiny'], attn='linformer', **_MNIST_ARGS), **kwargs))


@register_model
def soft_tiny_performer_mnist(pretrained: bool = False, **kwargs) -> SoftNet:
    """The Tiny backbone with performer attention on 28×28 MNIST."""
    return _create('soft_tiny_performer_mnist', pretrained, **dict(dict(_SIZES['tiny'], attn='performer', **_MNIST_ARGS), **kwargs))


@register_model
def soft_tiny_nystrom_mnist(pretrained: bool = False, **kwargs) -> SoftNet:
    """The Tiny backbone with nystrom attention on 28×28 MNIST."""
    return _create('soft_tiny_nystrom_mnist', pretrained, **dict(dict(_SIZES['tiny'], attn='nystrom', **_MNIST_ARGS), **kwargs))


@register_model
def soft_digits(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT on the embedded 8×8 digits."""
    return _create('soft_digits', pretrained, **dict(dict(_DIGITS_ARGS, attn='soft'), **kwargs))


@register_model
def softpp_digits(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++ on the embedded 8×8 digits."""
    return _create('softpp_digits', pretrained, **dict(dict(_DIGITS_ARGS, attn='softpp'), **kwargs))


def _official(variant: str, size: str, attn: str, pretrained: bool, kwargs) -> SoftNet:
    return _create(variant, pretrained, **dict(dict(_OFFICIAL_SIZES[size], attn=attn, official=True), **kwargs))


@register_model
def soft_tiny_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Tiny as the public code builds it (13.07M parameters; docs/soft.md lists every difference)."""
    return _official('soft_tiny_official_224', 'tiny', 'soft', pretrained, kwargs)


@register_model
def softpp_tiny_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Tiny as the public code means to build it (its SOFT++ classes fail to construct)."""
    return _official('softpp_tiny_official_224', 'tiny', 'softpp', pretrained, kwargs)


@register_model
def soft_small_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Small as the public code builds it."""
    return _official('soft_small_official_224', 'small', 'soft', pretrained, kwargs)


@register_model
def softpp_small_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Small as the public code means to build it."""
    return _official('softpp_small_official_224', 'small', 'softpp', pretrained, kwargs)


@register_model
def soft_medium_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Medium as the public code builds it."""
    return _official('soft_medium_official_224', 'medium', 'soft', pretrained, kwargs)


@register_model
def softpp_medium_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Medium as the public code means to build it."""
    return _official('softpp_medium_official_224', 'medium', 'softpp', pretrained, kwargs)


@register_model
def soft_large_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Large as the public code builds it."""
    return _official('soft_large_official_224', 'large', 'soft', pretrained, kwargs)


@register_model
def softpp_large_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Large as the public code means to build it."""
    return _official('softpp_large_official_224', 'large', 'softpp', pretrained, kwargs)


@register_model
def soft_huge_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT-Huge as the public code builds it (`soft_huge`: 87.11M parameters; not one of Table 1's sizes)."""
    return _official('soft_huge_official_224', 'huge', 'soft', pretrained, kwargs)


@register_model
def softpp_huge_official_224(pretrained: bool = False, **kwargs) -> SoftNet:
    """SOFT++-Huge as the public code means to build it (`soft_norm_huge`)."""
    return _official('softpp_huge_official_224', 'huge', 'softpp', pretrained, kwargs)
