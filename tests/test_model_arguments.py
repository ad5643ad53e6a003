"""Model and layer constructor arguments: a bad value is a ValueError naming the argument and its range, before
any layer is built, from the Python API (`timm.create_model`) and through `build_model` (`--model-kwargs`) for any model,
timm's own included. Each case failed before as named in its comment: deep inside torch or timm, silently, or only
in the first training step."""
import math

import pytest
import timm

import structformer  # noqa: F401  (registers the models)
from structformer.arguments import (check_conventional_kwargs, count, image_size, nonnegative_number, positive_int,
                                    positive_ints, positive_number, rate)
from structformer.layers.linear import FactorizedConv2d, MaskedLinear, PKLinear, TunedLinear
from structformer.layers.mlp import ISTA
from structformer.models.factory import build_model


@pytest.mark.parametrize('check, good, bad', [
    (positive_int, [1, 7], [0, -1, 2.5, True, '3', None]),
    (count, [0, 3], [-1, 1.0, False]),
    (rate, [0, 0.0, 0.5, 0.999], [1, 1.0, -0.1, math.nan, math.inf, True, '0.1']),
    (positive_number, [1e-6, 2], [0, -1e-6, math.nan, math.inf, True]),
    (nonnegative_number, [0, 4.0], [-1, math.nan, -math.inf, math.inf]),
    (image_size, [8, (8, 16), [4, 4]], [0, -1, 2.5, (8,), (8, 0), (8, 8, 8), '8', None]),
])
def test_each_check_takes_its_range_and_names_the_argument(check, good, bad):
    for value in good:
        check('arg', value)
    for value in bad:
        with pytest.raises(ValueError, match=r'^arg='):
            check('arg', value)


def test_per_stage_sequences_take_their_length_and_least_value():
    assert positive_ints('dims', [8, 16, 32, 64], 4) == (8, 16, 32, 64)
    assert positive_ints('depths', (0, 1, 0, 2), 4, least=0) == (0, 1, 0, 2)
    for bad in [(8, 16, 32), (8, 0, 32, 64), (8, 16, 32, 64.0), 8, 'abcd']:
        with pytest.raises(ValueError, match=r'^dims='):
            positive_ints('dims', bad, 4)


def test_timms_names_are_checked_with_their_one_meaning():
    check_conventional_kwargs({'num_heads': (3, 6, 12, 24), 'depth': 0, 'mlp_ratio': 4.0, 'attn_drop_rate': 0.1,
                               'norm_eps': 1e-6, 'img_size': None, 'anything_else': -5})    # Swin's per-stage heads
    for kwargs, needle in [({'num_heads': (3, 0)}, 'num_heads[1]=0'), ({'patch_drop_rate': 1.0}, 'patch_drop_rate'),
                           ({'drop_path_rate': -0.1}, 'drop_path_rate'), ({'layer_norm_eps': 0.0}, 'layer_norm_eps'),
                           ({'mlp_ratio': math.inf}, 'mlp_ratio'), ({'reg_tokens': -1}, 'reg_tokens'),
                           ({'embed_dim': ()}, 'embed_dim'), ({'patch_size': 0}, 'patch_size')]:
        with pytest.raises(ValueError, match=f'^--model-kwargs {needle}'.replace('[', r'\[').replace(']', r'\]')):
            check_conventional_kwargs(kwargs, '--model-kwargs ')


# (model, kwargs, words of the error): the model classes' own checks, as a Python user meets them
MODEL_CASES = [
    ('crate_digits', {'patch_size': 0}, 'patch_size=0'),                     # ZeroDivisionError (h % ph)
    ('crate_digits', {'drop_path_rate': 1.5}, 'drop_path_rate=1.5'),
    ('crate_digits', {'attn_drop_rate': -1.0}, 'attn_drop_rate=-1.0'),       # torch's dropout, unnamed
    ('crate_digits', {'num_classes': -1}, 'num_classes=-1'),                 # accepted as "no head"
    ('crate_digits', {'eta': math.inf}, 'eta must be a finite number'),      # NaN loss at the first step
    ('crate_digits', {'lambd': math.inf}, 'lambd must be a finite number'),  # all-zero codes, silently
    ('soft_digits', {'sampling_ratios': (0, 4, 2, 1)}, 'sampling_ratios'),   # ZeroDivisionError
    ('soft_digits', {'stem_strides': (2, 1)}, 'stem_strides'),               # IndexError
    ('soft_digits', {'stem_strides': (0, 1, 2)}, 'stem_strides'),            # ZeroDivisionError
    ('soft_digits', {'dims': (-1, 128, 320, 512)}, 'dims'),                  # a negative conv width
    ('soft_digits', {'depths': (-1, 2, 5, 2)}, 'depths'),                    # an empty stage, silently
    ('soft_digits', {'mlp_ratio': math.inf}, 'mlp_ratio=inf'),               # OverflowError
    ('soft_digits', {'drop_path_rate': 1.5}, 'drop_path_rate=1.5'),          # the first training step
    ('mixer_digits', {'depth': -1}, 'depth=-1'),                             # no blocks, silently
    ('mixer_digits', {'norm_eps': -1.0}, 'norm_eps=-1.0'),                   # NaN loss at the first step
    ('mixer_digits', {'patch_size': 0}, 'patch_size=0'),                     # timm's PatchEmbed: ZeroDivisionError
    ('rp_mixer_digits', {'embed_dim': -1}, 'embed_dim=-1'),                  # a negative conv width
    ('rp_mixer_digits', {'mlp_ratio': -1.0}, 'mlp_ratio=-1.0'),
    ('swmlp_digits', {'drop_rate': 1.5}, 'drop_rate=1.5'),
    ('swmlp_digits', {'depth': 0}, 'depth=0'),
    ('swmlp_digits', {'mask_seed': 2.5}, 'mask_seed=2.5'),                   # truncated to seed 2, silently
    ('rp_mixer_digits', {'perm_seed': -1}, 'perm_seed=-1'),
    ('vit_digits', {'depth': -1}, 'depth=-1'),                               # timm: "number of steps must be ..."
    ('vit_digits', {'num_heads': 0}, 'num_heads=0'),                         # timm: ZeroDivisionError
    ('sparsifiner_digits', {'mlp_ratio': math.inf}, 'mlp_ratio=inf'),        # timm: OverflowError
    ('sparsifiner_digits', {'drop_path_rate': 1.5}, 'drop_path_rate=1.5'),   # the first training step
]


@pytest.mark.parametrize('name, kwargs, needle', MODEL_CASES,
                         ids=[f"{n}-{'-'.join(k)}-{i}" for i, (n, k, _) in enumerate(MODEL_CASES)])
def test_a_models_bad_argument_is_named_before_it_is_built(name, kwargs, needle):
    with pytest.raises(ValueError) as caught:
        timm.create_model(name, **kwargs)
    assert needle in str(caught.value)


def test_build_model_names_the_model_kwargs_of_any_timm_model():
    """`--model-kwargs` of timm's own ViT: checked by timm's names before timm builds anything (before, a rate
    over 1 built and failed in the first training step's DropPath)."""
    with pytest.raises(ValueError, match=r'^--model-kwargs drop_path_rate=1\.5 must be a number in \[0, 1\)'):
        build_model('vit_tiny_patch16_224', {'drop_path_rate': 1.5, 'img_size': 8, 'patch_size': 2})
    with pytest.raises(ValueError, match=r'^--model-kwargs patch_size=0 must be a positive integer'):
        build_model('resmlp_12_224', {'patch_size': 0})
    with pytest.raises(ValueError, match=r'^--model-kwargs drop_block_rate=2\.0 must be a number in \[0, 1\)'):
        build_model('resnet18', {'drop_block_rate': 2.0})        # DropBlock's bernoulli_ at the first step
    # timm's assert without a message: its kind, not an empty reason after the colon
    with pytest.raises(ValueError, match=r"^cannot build resnet18 with \{'output_stride': 3\}: AssertionError$"):
        build_model('resnet18', {'output_stride': 3})


def test_any_failure_to_build_with_kwargs_is_one_error_naming_them(monkeypatch):
    """What the checks do not foresee (a layer's ZeroDivisionError, IndexError, OverflowError) is still a
    ValueError naming the model and its kwargs; built without any kwargs, the model itself is broken, and its
    error comes out as it was."""
    def broken(name, **kwargs):
        raise ZeroDivisionError('integer modulo by zero')
    monkeypatch.setattr(timm, 'create_model', broken)
    with pytest.raises(ValueError, match=r"^cannot build crate_digits with \{'dim_head': 4\}: ZeroDivisionError: "
                                         r"integer modulo by zero$"):
        build_model('crate_digits', {'dim_head': 4})
    with pytest.raises(ZeroDivisionError):
        build_model('crate_digits')



def _numeric_arguments():
    """(registered name, class, argument, default) for every int or float argument of every registered model class
    (one registered name per class), found by signature: a new argument is swept without a row."""
    import inspect

    import torch

    from structformer.models import list_structformer_models
    seen = {}
    for name in list_structformer_models() + timm.list_models('gpt2_byte_*'):      # the language models too
        with torch.device('meta'):
            cls = type(timm.create_model(name))
        if cls in seen:
            continue
        seen[cls] = name
        owner = next(k for k in cls.__mro__ if '__init__' in vars(k) and any(
            p.kind is p.POSITIONAL_OR_KEYWORD and p.name != 'self' for p in inspect.signature(k.__init__).parameters.values()))
        for p in inspect.signature(owner.__init__).parameters.values():
            if isinstance(p.default, (int, float)) and not isinstance(p.default, bool):
                yield name, cls.__name__, p.name, p.default


def test_every_numeric_model_argument_refuses_a_negative_or_nan_by_name():
    """-1 for every int or float constructor argument of every registered model class (and NaN for the floats):
    a ValueError naming the argument, raised before a layer is built (on the meta device: nothing is allocated).
    Before: WRN's in_chans=-1 failed inside a convolution, its num_classes=-1 built a model without a head, its
    drop_rate=-1 was refused by torch's dropout without a name."""
    import torch
    arguments = list(_numeric_arguments())
    assert len(arguments) > 60 and {c for _, c, _, _ in arguments} >= {'CRATE', 'SoftNet', 'SparseMixer', 'SWMLP',
                                                                      'WideResNet', 'SparsifinerViT', 'GPT'}
    for name, cls, arg, default in arguments:
        for bad in ([-1, math.nan] if isinstance(default, float) else [-1]):
            with pytest.raises(ValueError) as caught, torch.device('meta'):
                timm.create_model(name, **{arg: bad})
            assert arg in str(caught.value), (name, cls, arg, bad, str(caught.value))


def test_every_numeric_attention_argument_refuses_a_negative_or_nan_by_name():
    """The same walk over every registered attention class (dim 64, 4 heads otherwise): its dropout rates were
    refused by torch's nn.Dropout without a name, and NaN was taken; SOFT's eval seed -1 was taken."""
    import inspect

    import torch

    from structformer.layers.attention.registry import ATTENTION_LAYERS
    swept = 0
    for name, cls in sorted(ATTENTION_LAYERS.items()):
        for p in inspect.signature(cls.__init__).parameters.values():
            if isinstance(p.default, bool) or not isinstance(p.default, (int, float)):
                continue
            for bad in ([-1, math.nan] if isinstance(p.default, float) else [-1]):
                with pytest.raises(ValueError) as caught, torch.device('meta'):
                    cls(**{'dim': 64, 'num_heads': 4, p.name: bad})
                assert p.name in str(caught.value), (name, p.name, bad, str(caught.value))
                swept += 1
    assert swept > 30


@pytest.mark.parametrize('build, argument', [
    (lambda: TunedLinear(-1, 4), 'in_features'),
    (lambda: PKLinear(2, 4, 4, seed=2.5), 'seed'),
    (lambda: MaskedLinear(8, 8, seed=-1), 'seed'),
    (lambda: FactorizedConv2d(4, 4, 3, stride=0), 'stride'),
    (lambda: FactorizedConv2d(4, 4, 3, padding=(1, -1)), 'padding'),
    (lambda: ISTA(8, drop=1.5), 'drop'),
])
def test_linear_layers_name_their_bad_arguments(build, argument):
    """Before: TunedLinear's -1 failed in nn.Linear ("negative dimension"), seeds were truncated or taken
    negative, a factorised convolution took stride 0 and failed at its first forward, ISTA's dropout was torch's."""
    with pytest.raises(ValueError, match=rf'^{argument}='):
        build()


@pytest.mark.parametrize('name, kwargs', [('vit_digits', {'depth': 5}), ('crate_digits', {'depth': 6}),
                                          ('mixer_digits', {'depth': 5, 'embed_dim': 24}),
                                          ('soft_digits', {'depths': (2, 3, 1, 2)})])
def test_the_weights_of_many_blocks_are_counted_on_two_small_copies(monkeypatch, name, kwargs):
    """Beyond _COUNTED_BLOCKS blocks the count is extrapolated from builds with one and two blocks per stage; it is
    the count of the model built (parameters and buffers), here with the threshold lowered so the model is small."""
    from structformer.models import factory
    model, _ = build_model(name, kwargs)
    built = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))
    monkeypatch.setattr(factory, '_COUNTED_BLOCKS', 1)
    assert factory._estimated_parameters(name, kwargs) == built


@pytest.mark.parametrize('kwargs, needle', [({'depth': 10 ** 12}, 'depth=1000000000000'),
                                            ({'embed_dim': 200_000}, 'embed_dim=200000')])
def test_weights_beyond_memory_are_refused_before_a_block_is_built(monkeypatch, kwargs, needle):
    """depth=10**12 looped over its blocks until memory ran out; a width typo filled the memory layer by layer until
    the OOM killer ended the process without a word. Refused from a meta-device count, at once."""
    from structformer import machine
    with pytest.raises(ValueError, match=rf"^--model-kwargs {needle}: crate_digits in float32 \(~.* parameters\) "
                                         r"needs about .* GiB, more than this machine's"):
        build_model('crate_digits', kwargs)
    monkeypatch.setattr(machine, 'memory_bytes', lambda: 10 ** 6)        # 1 MB: crate_digits' 60 kB of weights fit
    build_model('crate_digits', {'depth': 2})
    with pytest.raises(ValueError, match=r'^--model-kwargs depth=100: crate_digits in float32'):
        build_model('crate_digits', {'depth': 100})                      # 1.25M parameters: 5 MB


def test_an_allocation_failure_where_nothing_could_be_counted_is_named(monkeypatch):
    """A model the meta device cannot build is not counted: the real build's allocator error is still one line."""
    from structformer.models import factory

    def allocate(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(factory, '_estimated_parameters', lambda name, kwargs: None)
    monkeypatch.setattr(timm, 'create_model', allocate)
    with pytest.raises(ValueError, match=r"^cannot build crate_digits with .*: its weights do not fit in memory "
                                         r"\(\[enforce fail"):
        build_model('crate_digits', {'depth': 2})
