"""Tests of training-time augmentation (structformer.data.augment): timm's pieces in every image dataset,
reproducible under seeding of the global RNGs, the untouched default path, and clear errors."""
import json
import pickle
import random
import struct

import numpy as np
import pytest
import torch

from structformer.data import build_datasets
from structformer.data.augment import Augmentation, auto_augment_policy
from structformer.errors import UsageError

ALL_ON = dict(aa='rand-m9-mstd0.5-inc1', reprob=0.5, remode='pixel', recount=2, color_jitter=0.4,
              scale=(0.5, 1.0), ratio=(0.8, 1.25), hflip=0.5)
# one setting at a time: each must change the images
SINGLE = {
    'rand': dict(aa='rand-m9-mstd0.5-inc1'),
    'autoaugment': dict(aa='original'),
    'augmix': dict(aa='augmix-m5-w3-d2'),
    'scale': dict(scale=(0.3, 0.6)),
    'ratio': dict(ratio=(0.5, 2.0)),
    'hflip': dict(hflip=1.0),
    'color_jitter': dict(color_jitter=0.4),
    'reprob': dict(reprob=1.0),
}


# ----- tiny data on disk -----

def _shapes(rng, n, size, channels):
    """Dark images with a bright off-centre rectangle, so flips, crops and shifts change them."""
    images = rng.integers(0, 30, size=(n, size, size, channels), dtype=np.uint8)
    for img in images:
        top, left = rng.integers(0, size // 2, 2)
        img[top:top + size // 3, left:left + size // 4] = rng.integers(150, 256, channels, dtype=np.uint8)
    return images


def _write_mnist(folder, n=20):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    images = _shapes(rng, n, 28, 1)[..., 0]
    labels = (np.arange(n) % 10).astype(np.uint8)
    for name, array, magic in (('t10k-images-idx3-ubyte', images, 2051), ('t10k-labels-idx1-ubyte', labels, 2049)):
        header = struct.pack('>I', magic) + b''.join(struct.pack('>I', d) for d in array.shape)
        (folder / name).write_bytes(header + array.tobytes())
    return folder


def _write_cifar(folder, per_batch=4):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']:
        data = _shapes(rng, per_batch, 32, 3).transpose(0, 3, 1, 2).reshape(per_batch, 3072)
        with open(folder / name, 'wb') as f:
            pickle.dump({b'data': data, b'labels': list(range(per_batch))}, f)
    return folder


def _write_pngs(folder, per_class=4):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in ('cat', 'dog'):
        (folder / c).mkdir(parents=True)
        for i, img in enumerate(_shapes(rng, per_class, 16, 3)):
            Image.fromarray(img).save(folder / c / f'{i}.png')
    return folder


@pytest.fixture(params=['digits', 'mnist', 'cifar10'])
def in_memory(request, tmp_path):
    """(spec, data options) of each in-memory image dataset; the built-in augment option off."""
    if request.param == 'digits':
        return 'digits', {}
    if request.param == 'mnist':
        return f'mnist:{_write_mnist(tmp_path / "mnist")}', {'augment': False}
    return f'cifar10:{_write_cifar(tmp_path / "cifar")}', {'augment': False}


def _seed(seed):
    """What the engine does before each sample: seed every global RNG."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _samples(dataset, n, seed=0):
    out = []
    for i in range(n):
        _seed(seed * 1000 + i)
        out.append(dataset[i][0])
    return torch.stack(out)


# ----- in-memory datasets -----

@pytest.mark.parametrize('option', list(SINGLE))
def test_in_memory_each_option_changes_images_reproducibly(in_memory, option):
    spec, opts = in_memory
    plain, _, info = build_datasets(spec, **opts)
    train, val, aug_info = build_datasets(spec, augmentation=Augmentation(**SINGLE[option]), **opts)
    n = min(8, len(train))
    base, first, again = _samples(plain, n), _samples(train, n), _samples(train, n)
    assert first.shape == base.shape and first.dtype == torch.float32
    assert first.shape[1:] == (info.in_chans, info.img_size, info.img_size)
    assert torch.isfinite(first).all()
    assert not torch.equal(first, base)                     # the option did something
    assert torch.equal(first, again)                        # identical seeding, identical images
    assert val.augmentation is None and torch.equal(val[0][0], build_datasets(spec, **opts)[1][0][0])
    record = aug_info.extra['augmentation']
    json.dumps(record)
    assert record['pipeline'] and info.extra['augmentation'] is None


def test_every_augmentation_together_is_reproducible_under_seeding(in_memory):
    spec, opts = in_memory
    train, _, info = build_datasets(spec, augmentation=Augmentation(**ALL_ON), **dict(opts, augment=True))
    assert info.extra['augmentation']['pipeline'] == [
        'RandomResizedCropAndInterpolation', 'RandomHorizontalFlip', 'RandAugment', 'RandomErasing']
    assert info.extra['augmentation']['color_jitter'] is None        # as in timm: no jitter with --aa
    for i in range(4):
        _seed(7)
        a = train[i][0]
        _seed(7)
        b = train[i][0]
        assert torch.equal(a, b)
    assert not torch.equal(_samples(train, 4, seed=1), _samples(train, 4, seed=2))


def test_no_augmentation_requested_leaves_the_output_unchanged(in_memory):
    spec, opts = in_memory
    for augment in (False, True):
        plain = build_datasets(spec, **dict(opts, augment=augment))[0]
        for augmentation in (None, Augmentation()):
            train, _, info = build_datasets(spec, augmentation=augmentation, **dict(opts, augment=augment))
            assert train.pixel_augment is None and train.erase is None and info.extra['augmentation'] is None
            torch.manual_seed(3)
            a = torch.stack([train[i][0] for i in range(6)])
            torch.manual_seed(3)
            b = torch.stack([plain[i][0] for i in range(6)])
            assert torch.equal(a, b)


def test_random_erasing_erases(in_memory):
    spec, opts = in_memory
    plain = build_datasets(spec, **opts)[0]
    train = build_datasets(spec, augmentation=Augmentation(reprob=1.0, remode='const', recount=2), **opts)[0]
    base, erased = _samples(plain, 6), _samples(train, 6)
    changed = erased != base
    assert changed.any(dim=(1, 2, 3)).all()                   # every image erased (probability 1)
    assert (erased[changed] == 0).all()                       # to the 'const' fill: normalised 0


def test_digits_raw_units_survive_the_pil_round_trip():
    """Digits' 0..16 pixels go to PIL as 0..255 and come back in raw units: a certain flip is exactly a flip."""
    plain = build_datasets('digits')[0]
    flipped = build_datasets('digits', augmentation=Augmentation(hflip=1.0))[0]
    for i in range(5):
        assert torch.allclose(flipped[i][0], plain[i][0].flip(-1), atol=0.01)


@pytest.mark.parametrize('policy', ['rand-n15-m9-mstd0.5-inc1', 'rand-n15-m9-mstd0.5', 'original', 'v0',
                                    'augmix-m9-w3-d3'])
def test_every_auto_augment_op_works_on_small_grey_and_rgb_images(policy, tmp_path):
    # n15: each sample applies (with probability 0.5 each) 15 of the ~15 ops, so all of them run
    for spec in ('digits', f'mnist:{_write_mnist(tmp_path / "m")}', f'cifar10:{_write_cifar(tmp_path / "c")}'):
        train = build_datasets(spec, augmentation=Augmentation(aa=policy))[0]
        x = _samples(train, 12)
        assert torch.isfinite(x).all()


def test_zero_bit_posterize_gives_a_black_image_not_an_error():
    """timm asks for 0 bits at the strongest posterize; the installed Pillow raises for it."""
    from PIL import Image
    transform = auto_augment_policy('rand-m10-n1-inc1', 8, (78,))
    op = next(op for op in transform.ops if op.name == 'PosterizeIncreasing')
    op.prob, op.magnitude_std = 1.0, 0.0
    image = Image.fromarray(np.full((8, 8), 200, dtype=np.uint8), 'L')
    assert np.asarray(op(image)).max() == 0
    train = build_datasets('digits', augmentation=Augmentation(aa='rand-m10-inc1'))[0]
    _samples(train, 200)                                     # about 1 in 13 samples posterizes to 0 bits


def test_augmented_dataset_pickles_for_worker_processes():
    train = build_datasets('digits', augmentation=Augmentation(**ALL_ON))[0]
    copy = pickle.loads(pickle.dumps(train))
    assert torch.equal(_samples(train, 4), _samples(copy, 4))


# ----- imagefolder -----

def test_imagefolder_uses_timms_create_transform(tmp_path):
    folder = _write_pngs(tmp_path / 'imgs')
    aug = Augmentation(aa='rand-m9-mstd0.5-inc1', reprob=0.25, remode='pixel', recount=2, scale=(0.5, 1.0),
                       hflip=0.25, color_jitter=0.3)
    plain_train, plain_val, _ = build_datasets(f'imagefolder:{folder}', img_size=16)
    train, val, info = build_datasets(f'imagefolder:{folder}', img_size=16, augmentation=aug)
    steps = {type(t).__name__: t for t in train.dataset.transform.transforms}
    assert list(steps) == ['RandomResizedCropAndInterpolation', 'RandomHorizontalFlip', 'RandAugment',
                           'MaybeToTensor', 'Normalize', 'RandomErasing']     # no ColorJitter with --aa (timm)
    assert steps['RandomResizedCropAndInterpolation'].scale == (0.5, 1.0)
    assert steps['RandomHorizontalFlip'].p == 0.25
    erase = steps['RandomErasing']
    assert (erase.probability, erase.mode, erase.max_count) == (0.25, 'pixel', 2)
    assert repr(val.dataset.transform) == repr(plain_val.dataset.transform)        # eval unchanged
    record = info.extra['augmentation']
    assert record['pipeline'] == list(steps) and record['hflip'] == 0.25 and record['ratio'] == [0.75, 4 / 3]
    json.dumps(info.summary())
    x = _samples(train, 4)
    assert x.shape == (4, 3, 16, 16) and torch.equal(x, _samples(train, 4))
    unaugmented = torch.stack([plain_val.dataset[train.indices[i]][0] for i in range(4)])   # eval transform
    assert not torch.equal(x, unaugmented)


@pytest.mark.parametrize('given, crop, ops', [(None, 'bilinear', 'bilinear'), ('bicubic', 'bicubic', 'bicubic'),
                                              ('random', 'random', 'random')])
def test_train_interpolation_reaches_the_crop_and_the_policy(given, crop, ops, tmp_path):
    """--train-interpolation (timm train.py's flag; DeiT's main.py trains with bicubic, timm's and SOFT's with
    random): the random-resized crop and every RandAugment op resample with it, for files and in-memory images.
    It was not a setting: every recipe cropped and rotated bilinear whatever its public code said."""
    from PIL import Image
    from timm.data.auto_augment import _RANDOM_INTERPOLATION
    pil = {'bilinear': Image.BILINEAR, 'bicubic': Image.BICUBIC, 'random': _RANDOM_INTERPOLATION}
    aug = Augmentation(aa='rand-m9-mstd0.5-inc1', scale=(0.5, 1.0), train_interpolation=given)
    folder = _write_pngs(tmp_path / 'imgs')
    train, _, info = build_datasets(f'imagefolder:{folder}', img_size=16, augmentation=aug)
    steps = {type(t).__name__: t for t in train.dataset.transform.transforms}
    from structformer.data.augment import check_augmentation, raw_image_augmentation
    pixel, _, _ = raw_image_augmentation(check_augmentation(aug), channels=3, size=(16, 16), raw_max=255.0,
                                         mean_pixel=(120.0, 110.0, 100.0))
    memory = {type(t).__name__: t for t in pixel.steps.transforms}
    for found in (steps, memory):
        rrc = found['RandomResizedCropAndInterpolation']
        if crop == 'random':                           # timm draws bilinear or bicubic per image
            assert {m.value for m in rrc.interpolation} == {'bilinear', 'bicubic'}
        else:
            assert rrc.interpolation.value == crop
        assert {op.kwargs['resample'] for op in found['RandAugment'].ops} == {pil[ops]}
    assert info.extra['augmentation']['train_interpolation'] == given


def test_imagefolder_colour_jitter_only_when_asked(tmp_path):
    folder = _write_pngs(tmp_path / 'imgs')
    names = lambda aug: [type(t).__name__ for t in                                   # noqa: E731
                         build_datasets(f'imagefolder:{folder}', img_size=16, augmentation=aug)[0]
                         .dataset.transform.transforms]
    assert 'ColorJitter' not in names(Augmentation(reprob=0.5))     # timm would jitter by 0.4 here
    assert 'ColorJitter' in names(Augmentation(color_jitter=0.3))


def test_imagefolder_without_flags_keeps_its_default_transform(tmp_path):
    folder = _write_pngs(tmp_path / 'imgs')
    plain, _, _ = build_datasets(f'imagefolder:{folder}', img_size=16)
    train, _, info = build_datasets(f'imagefolder:{folder}', img_size=16, augmentation=Augmentation())
    assert repr(train.dataset.transform) == repr(plain.dataset.transform)
    assert type(train.dataset.transform.transforms[0]).__name__ == 'RandomResizedCrop'      # torchvision's
    assert info.extra['augmentation'] is None


def test_imagefolder_augment_false_with_flags_is_refused(tmp_path):
    folder = _write_pngs(tmp_path / 'imgs')
    with pytest.raises(UsageError, match=r'augment=false .* --aa'):
        build_datasets(f'imagefolder:{folder}', augment=False, augmentation=Augmentation(aa='original'))


# ----- errors -----

@pytest.mark.parametrize('settings, flag', [
    (dict(aa='rand-m9-zz'), '--aa'), (dict(aa='v9'), '--aa'), (dict(reprob=1.5), '--reprob'),
    (dict(remode='zero'), '--remode'), (dict(recount=0), '--recount'), (dict(color_jitter=-0.1), '--color-jitter'),
    (dict(scale=(0.9, 0.1)), '--scale'), (dict(scale=(0.5,)), '--scale'), (dict(ratio=(0.0, 1.0)), '--ratio'),
    (dict(hflip=2.0), '--hflip'), (dict(train_interpolation='cubic'), '--train-interpolation'),
])
def test_bad_settings_name_the_flag_and_accepted_values(settings, flag):
    with pytest.raises(UsageError, match=rf'^{flag}=.*accepted'):
        build_datasets('digits', augmentation=Augmentation(**settings))


@pytest.mark.parametrize('spec', ['synthetic-subspaces', 'pysource', 'text'])
def test_non_image_data_refuses_augmentation(spec, tmp_path):
    if spec == 'text':
        for i in range(2):
            (tmp_path / f'{i}.txt').write_text('some text to model, ' * 200)
        spec = f'text:{tmp_path}'
    with pytest.raises(UsageError) as e:
        build_datasets(spec, augmentation=Augmentation(aa='original', reprob=0.25))
    message = str(e.value)
    assert '\n' not in message and message.startswith('--aa, --reprob:')
    assert 'digits, mnist:PATH, cifar10:PATH, imagefolder:PATH' in message and spec in message
    build_datasets(spec, augmentation=Augmentation(), **({'num_samples': 40} if spec.startswith('synth') else {}))
