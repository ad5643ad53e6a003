"""Tests of structformer.data: every --data form, its splits, its normalisation and its errors."""
import gzip
import json
import os
import pickle
import re
import struct
from collections import Counter

import numpy as np
import pytest
import torch

from structformer.data import (DATASET_FORMS, build_datasets, image_to_tokens, parse_data_spec, read_idx,
                               tokens_to_image)

# The real 10,000-image MNIST test set, shared with the project's CI; it must never be committed.
SHARED_MNIST = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data', 'mnist')
MNIST_T10K_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ----- digits -----

def test_digits_sizes_shapes_and_normalisation():
    train, val, info = build_datasets('digits')
    assert (info.train_size, info.val_size, len(train) + len(val)) == (1437, 360, 1797)
    assert (info.num_classes, info.in_chans, info.img_size) == (10, 1, 8)
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)
    assert set(train.labels.tolist()) == set(val.labels.tolist()) == set(range(10))
    allx = torch.cat([train.normalized_images(), val.normalized_images()])
    assert abs(allx.mean().item()) < 1e-3 and abs(allx.std().item() - 1) < 1e-3


def test_digits_split_stratified_and_seeded():
    tr_a, va_a, _ = build_datasets('digits', seed=0)
    tr_b, va_b, _ = build_datasets('digits', seed=0)
    tr_c, va_c, _ = build_datasets('digits', seed=1)
    assert torch.equal(va_a.source_indices, va_b.source_indices)
    assert torch.equal(tr_a.images, tr_b.images)
    assert not torch.equal(va_a.source_indices, va_c.source_indices)
    # train and val partition the 1,797 images
    both = torch.cat([tr_a.source_indices, va_a.source_indices]).sort().values
    assert torch.equal(both, torch.arange(1797))
    # stratified: each class holds 20% of its images in val, to within one image
    total = Counter(tr_a.labels.tolist()) + Counter(va_a.labels.tolist())
    val_counts = Counter(va_a.labels.tolist())
    for c in range(10):
        assert abs(val_counts[c] - 0.2 * total[c]) <= 1


def test_digits_augment_draws_from_torch_rng():
    train, _, _ = build_datasets('digits', augment='true')
    plain, _, _ = build_datasets('digits')
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = torch.stack([train[i][0] for i in range(50)])
    torch.set_rng_state(state)
    again = torch.stack([train[i][0] for i in range(50)])
    assert torch.equal(first, again)                  # restoring the RNG state repeats the augmentation
    reference = torch.stack([plain[i][0] for i in range(50)])
    assert not torch.equal(first, reference)          # and it does shift some images


# ----- synthetic subspaces (CRATE §2.2) -----

def test_synthetic_deterministic_and_seeded():
    a = build_datasets('synthetic-subspaces', seed=3, num_samples=200)
    b = build_datasets('synthetic-subspaces', seed=3, num_samples=200)
    c = build_datasets('synthetic-subspaces', seed=4, num_samples=200)
    assert torch.equal(a[0].images, b[0].images) and torch.equal(a[1].labels, b[1].labels)
    assert torch.equal(a[2].extra['subspace_bases'], b[2].extra['subspace_bases'])
    assert not torch.allclose(a[2].extra['subspace_bases'], c[2].extra['subspace_bases'])
    info = a[2]
    assert (info.num_classes, info.in_chans, info.img_size, info.extra['patch_size']) == (4, 1, 16, 4)
    assert (info.train_size, info.val_size) == (160, 40)
    json.dumps(info.summary())                                  # run configs can record it
    assert info.summary()['extra']['subspace_bases'] == 'tensor[4, 16, 3]'
    allx = a[0].normalized_images()
    assert abs(allx.mean().item()) < 0.05 and abs(allx.std().item() - 1) < 0.05


def test_synthetic_bases_orthonormal_and_orthogonal():
    _, _, info = build_datasets('synthetic-subspaces', num_samples=40, num_classes=4, subspace_dim=3,
                                token_dim=16)
    bases = info.extra['subspace_bases']                       # K x D x p
    assert bases.shape == (4, 16, 3) and info.extra['orthogonal']
    gram = torch.einsum('kdp,jdq->kjpq', bases, bases)         # all pairwise B_kᵀB_j
    for k in range(4):
        for j in range(4):
            target = torch.eye(3) if k == j else torch.zeros(3, 3)
            assert torch.allclose(gram[k, j], target, atol=1e-5)
    # K·p > D: independent bases, each still orthonormal, but not mutually orthogonal
    _, _, info = build_datasets('synthetic-subspaces', num_samples=40, num_classes=4, subspace_dim=5,
                                token_dim=16)
    bases = info.extra['subspace_bases']
    assert not info.extra['orthogonal']
    assert torch.allclose(bases.transpose(1, 2) @ bases, torch.eye(5).expand(4, 5, 5), atol=1e-5)
    assert (bases[0].T @ bases[1]).abs().max() > 1e-3


def test_synthetic_image_token_round_trip_matches_vit_patch_embedding():
    from timm.layers import PatchEmbed
    tokens = torch.randn(3, 16, 16)                            # B, N=16 tokens, D=16 (4x4 patches)
    image = tokens_to_image(tokens)
    assert image.shape == (3, 1, 16, 16)
    assert torch.equal(image_to_tokens(image, 4), tokens)
    # token 1 is the patch right of token 0, and its first row is its first √D values
    assert torch.equal(image[0, 0, 0, 4:8], tokens[0, 1, :4])
    assert torch.equal(image[0, 0, 4, 0:4], tokens[0, 4, :4])
    # A ViT patch embedding whose projection is the identity sees exactly these tokens.
    embed = PatchEmbed(img_size=16, patch_size=4, in_chans=1, embed_dim=16)
    with torch.no_grad():
        embed.proj.weight.copy_(torch.eye(16).reshape(16, 1, 4, 4))
        embed.proj.bias.zero_()
        assert torch.allclose(embed(image), tokens, atol=1e-6)


def test_synthetic_pure_noiseless_tokens_lie_in_class_subspace():
    train, _, info = build_datasets('synthetic-subspaces', num_samples=80, noise=0, purity=1)
    bases = info.extra['subspace_bases']
    tokens = image_to_tokens(train.normalized_images(), info.extra['patch_size'])      # n, N, D
    own = bases[train.labels]                                                           # n, D, p
    projected = own @ (own.transpose(1, 2) @ tokens.transpose(1, 2))                    # n, D, N
    residual = (tokens.transpose(1, 2) - projected).norm() / tokens.norm()
    assert residual < 1e-5
    assert torch.equal(train.token_subspaces, train.labels[:, None].expand(-1, 16))
    # purity=0: no token comes from its own class subspace; purity=0.75: about 3/4 do
    train, _, _ = build_datasets('synthetic-subspaces', num_samples=80, purity=0)
    assert not (train.token_subspaces == train.labels[:, None]).any()
    train, _, _ = build_datasets('synthetic-subspaces', num_samples=400)
    frac = (train.token_subspaces == train.labels[:, None]).float().mean().item()
    assert abs(frac - 0.75) < 0.03


# ----- MNIST IDX -----

@pytest.mark.skipif(not os.path.isdir(SHARED_MNIST), reason='shared MNIST test set not present')
def test_mnist_shared_test_set():
    train, val, info = build_datasets(f'mnist:{SHARED_MNIST}')
    assert (info.train_size, info.val_size, info.img_size, info.in_chans) == (8000, 2000, 28, 1)
    assert torch.equal(val.source_indices, torch.arange(8000, 10000))
    labels = torch.cat([train.labels, val.labels])
    assert torch.bincount(labels, minlength=10).tolist() == MNIST_T10K_COUNTS
    assert '8000' in info.description and train[0][0].shape == (1, 28, 28)


def _write_idx(path, array, magic, compress):
    payload = struct.pack('>I', magic) + struct.pack(f'>{array.ndim}I', *array.shape) + array.tobytes()
    with (gzip.open if compress else open)(path, 'wb') as f:
        f.write(payload)
    return payload


@pytest.mark.parametrize('compress', [True, False])
def test_mnist_tiny_idx_round_trip(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(10, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=10).astype(np.uint8)
    ext = '.gz' if compress else ''
    _write_idx(tmp_path / f't10k-images-idx3-ubyte{ext}', images, 2051, compress)
    _write_idx(tmp_path / f't10k-labels-idx1-ubyte{ext}', labels, 2049, compress)
    assert np.array_equal(read_idx(str(tmp_path / f't10k-images-idx3-ubyte{ext}')), images)
    train, val, info = build_datasets(f'mnist:{tmp_path}')
    assert (info.train_size, info.val_size) == (8, 2)
    assert np.array_equal(torch.cat([train.images, val.images])[:, 0].numpy(), images)
    assert np.array_equal(torch.cat([train.labels, val.labels]).numpy(), labels)
    # with a train pair too: train files train, t10k files val
    _write_idx(tmp_path / 'train-images-idx3-ubyte', images[:6], 2051, False)
    _write_idx(tmp_path / 'train-labels-idx1-ubyte', labels[:6], 2049, False)
    train, val, info = build_datasets(f'mnist:{tmp_path}')
    assert (len(train), len(val)) == (6, 10) and torch.equal(val.images[:, 0], torch.from_numpy(images))


def test_mnist_truncated_or_corrupt_file_is_a_clear_error(tmp_path):
    images = np.zeros((5, 28, 28), dtype=np.uint8)
    payload = _write_idx(tmp_path / 't10k-images-idx3-ubyte', images, 2051, False)
    _write_idx(tmp_path / 't10k-labels-idx1-ubyte', np.zeros(5, np.uint8), 2049, False)
    (tmp_path / 't10k-images-idx3-ubyte').write_bytes(payload[:-100])
    with pytest.raises(ValueError, match='t10k-images-idx3-ubyte.*truncated'):
        build_datasets(f'mnist:{tmp_path}')
    (tmp_path / 't10k-images-idx3-ubyte').write_bytes(gzip.compress(payload)[:-20])   # truncated gzip
    with pytest.raises(ValueError, match='t10k-images-idx3-ubyte.*gzip'):
        build_datasets(f'mnist:{tmp_path}')
    (tmp_path / 't10k-images-idx3-ubyte').write_bytes(struct.pack('>I', 2049) + payload[4:])  # wrong magic
    with pytest.raises(ValueError, match='magic number 2049, expected 2051'):
        build_datasets(f'mnist:{tmp_path}')


def test_mnist_folder_without_idx_files(tmp_path):
    (tmp_path / 't10k-images-idx3-ubyte').write_bytes(b'')
    with pytest.raises(FileNotFoundError, match='t10k-labels-idx1-ubyte.*incomplete pair: t10k'):
        build_datasets(f'mnist:{tmp_path}')


# ----- CIFAR-10 -----

def _write_cifar(folder, n=4):
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(1)
    batches = {}
    for name in [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(folder / name, 'wb') as f:
            pickle.dump({b'data': data, b'labels': labels}, f)
        batches[name] = (data, labels)
    return batches


def test_cifar10_tiny_folder(tmp_path):
    batches = _write_cifar(tmp_path / 'cifar')
    train, val, info = build_datasets(f'cifar10:{tmp_path / "cifar"}')
    assert (info.train_size, info.val_size, info.in_chans, info.img_size, info.num_classes) == (20, 4, 3, 32, 10)
    x, y = val[1]
    assert x.shape == (3, 32, 32) and y == batches['test_batch'][1][1]
    # rows are 1024 red, then green, then blue values, each row-major 32x32
    raw = batches['test_batch'][0][1]
    assert torch.equal(val.images[1, 1, 0, :], torch.from_numpy(raw[1024:1056]))
    assert train.labels.tolist() == sum((batches[f'data_batch_{i}'][1] for i in range(1, 6)), [])
    assert train.augment == 'crop4_flip' and val.augment is None
    os.remove(tmp_path / 'cifar' / 'data_batch_3')
    with pytest.raises(FileNotFoundError, match=r'files data_batch_3 \(the python version: data_batch_1\.\.5'):
        build_datasets(f'cifar10:{tmp_path / "cifar"}')


class _Payload:
    """Unpickling this calls os.mkdir(marker): the test checks the call never happens."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_cifar10_refuses_a_planted_payload_before_it_runs(tmp_path):
    folder, marker = tmp_path / 'cifar', tmp_path / 'payload-ran'
    _write_cifar(folder)
    with open(folder / 'data_batch_2', 'wb') as f:
        pickle.dump({b'data': _Payload(marker), b'labels': [0]}, f)
    with pytest.raises(ValueError, match=r'data_batch_2: not a CIFAR-10 batch.*refusing to load posix\.mkdir'):
        build_datasets(f'cifar10:{folder}')
    assert not marker.exists()
    with open(folder / 'data_batch_2', 'wb') as f:           # a top-level payload, not inside the dict
        pickle.dump(_Payload(marker), f)
    with pytest.raises(ValueError, match='refusing to load'):
        build_datasets(f'cifar10:{folder}')
    assert not marker.exists()


def test_cifar10_reads_the_python2_era_pickle_protocol(tmp_path):
    """The published files are protocol-2 pickles with py2 strings; those need numpy's rebuild functions
    and _codecs.encode, which the restricted unpickler admits."""
    folder = tmp_path / 'cifar'
    batches = _write_cifar(folder)
    data, labels = batches['test_batch']
    with open(folder / 'test_batch', 'wb') as f:
        pickle.dump({b'batch_label': 'testing batch 1 of 1', b'labels': labels, b'data': data,
                     b'filenames': [b'a.png'] * len(labels)}, f, protocol=2)
    _, val, _ = build_datasets(f'cifar10:{folder}')
    assert torch.equal(val.images.reshape(len(labels), -1), torch.from_numpy(data)) and val.labels.tolist() == labels


# ----- image folders -----

def _write_pngs(folder, classes=('cat', 'dog'), per_class=4):
    from PIL import Image
    rng = np.random.default_rng(2)
    for c in classes:
        (folder / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(folder / c / f'{i}.png')


def test_imagefolder_split_and_train_val_layout(tmp_path):
    _write_pngs(tmp_path / 'flat')
    train, val, info = build_datasets(f'imagefolder:{tmp_path / "flat"}', img_size=16, val_fraction=0.25)
    assert (info.num_classes, info.in_chans, info.img_size, info.train_size, info.val_size) == (2, 3, 16, 6, 2)
    assert info.extra['classes'] == ['cat', 'dog']
    x, y = val[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y in (0, 1)
    assert train[0][0].shape == (3, 16, 16)
    assert sorted(val[i][1] for i in range(2)) == [0, 1]          # stratified
    _write_pngs(tmp_path / 'tv' / 'train', per_class=3)
    _write_pngs(tmp_path / 'tv' / 'val', per_class=2)
    train, val, info = build_datasets(f'imagefolder:{tmp_path / "tv"}', img_size='8')
    assert (len(train), len(val), info.img_size) == (6, 4, 8) and val[3][0].shape == (3, 8, 8)


# ----- timm's transforms from a model's config feed what training fed -----

def _timm_eval_input(pretrained_cfg, image_hwc):
    """timm's own eval pipeline (resolve_data_config + create_transform) on one 8-bit image; the config is a
    dict or a registered model's name."""
    import timm.data
    from PIL import Image
    if isinstance(pretrained_cfg, str):
        pretrained_cfg = timm.get_pretrained_cfg(pretrained_cfg).to_dict()
    cfg = timm.data.resolve_data_config({}, pretrained_cfg=pretrained_cfg)
    array = image_hwc[..., 0] if image_hwc.shape[-1] == 1 else image_hwc
    return timm.data.create_transform(**cfg)(Image.fromarray(array))


def _registered(suffix):
    import timm

    import structformer  # noqa: F401  (registers the models)
    return [n for n in timm.list_models('*' + suffix) if timm.get_pretrained_cfg(n) is not None]


def _assert_configs_feed_the_training_input(names, val, index):
    """timm's eval transform from each model's registered config, on val image `index` as an 8-bit image,
    equals the tensor the engine trains on."""
    assert len(names) >= 5, names
    image = val.images[index].permute(1, 2, 0).numpy()
    for name in names:
        torch.testing.assert_close(_timm_eval_input(name, image), val[index][0], msg=name)


def test_registered_digits_and_mnist_configs_reproduce_the_training_normalisation(shared_mnist):
    """A model named for a dataset declares that dataset's training normalisation in timm's pixel units, so
    timm's eval transform on the 8-bit image gives the engine's tensor (it gave ImageNet/identity before)."""
    _, digits_val, _ = build_datasets('digits')
    _, mnist_val, _ = build_datasets(f'mnist:{shared_mnist}')
    for suffix, val in (('_digits', digits_val), ('_mnist', mnist_val)):
        _assert_configs_feed_the_training_input(_registered(suffix), val, 3)


def test_registered_cifar_configs_reproduce_the_training_normalisation(tmp_path):
    _write_cifar(tmp_path / 'cifar')
    _, val, _ = build_datasets(f'cifar10:{tmp_path / "cifar"}')
    _assert_configs_feed_the_training_input(_registered('_cifar') + ['wrn_16_4'], val, 1)


def test_eval_data_config_reproduces_the_imagefolder_eval_transform(tmp_path):
    from PIL import Image

    from structformer.data.pixel_stats import eval_data_config
    _write_pngs(tmp_path / 'flat')
    _, val, info = build_datasets(f'imagefolder:{tmp_path / "flat"}', img_size=16, val_fraction=0.25)
    path = val.dataset.samples[val.indices[0]][0]                 # a stratified Subset of the ImageFolder
    cfg = dict(eval_data_config('imagefolder'), input_size=(3, 16, 16))
    image = np.asarray(Image.open(path).convert('RGB'))
    torch.testing.assert_close(_timm_eval_input(cfg, image), val[0][0])
    assert eval_data_config('synthetic-subspaces') is None
    import subprocess
    import sys

    import timm.data
    from structformer.data import pixel_stats
    assert (pixel_stats.IMAGENET_DEFAULT_MEAN, pixel_stats.IMAGENET_DEFAULT_STD) == (
        timm.data.IMAGENET_DEFAULT_MEAN, timm.data.IMAGENET_DEFAULT_STD)
    # imported first in a fresh process it must not re-enter itself through timm's registration hook
    subprocess.run([sys.executable, '-c', 'import structformer.data.pixel_stats'], check=True)



def test_crop_pct_and_interpolation_shape_the_held_out_images(tmp_path):
    """--data-kwargs crop_pct: timm's eval geometry (resize to img_size / crop_pct, centre crop). 1.0 scores the
    whole image, as CIFAR's and STL's test sets are scored and as the public CRATE finetune.py does; timm's 0.875
    upscaled a 32-px CIFAR-100 image to 36 px and cut its border. Export's pretrained_cfg follows the run's."""
    import torch.nn as nn
    from PIL import Image
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from structformer.data.pixel_stats import eval_data_config
    from structformer.train.checkpoint import record_training_data
    rng = np.random.default_rng(5)
    for folder, side in (('sq', 8), ('big', 20)):              # 8 px read at 8; 20 px read at 8 (a resize)
        for c in ('cat', 'dog'):
            (tmp_path / folder / c).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
                    tmp_path / folder / c / f'{i}.png')
    spec = f'imagefolder:{tmp_path / "sq"}'
    _, val, info = build_datasets(spec, img_size=8, val_fraction=0.25, crop_pct=1.0)
    _, val_timm, _ = build_datasets(spec, img_size=8, val_fraction=0.25)
    path = val.dataset.samples[val.indices[0]][0]
    image = np.asarray(Image.open(path).convert('RGB'))
    whole = (torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 255 - torch.tensor(IMAGENET_DEFAULT_MEAN)[:, None, None]
             ) / torch.tensor(IMAGENET_DEFAULT_STD)[:, None, None]
    torch.testing.assert_close(val[0][0], whole)
    assert not torch.allclose(val_timm[0][0], whole, atol=1e-3)        # 0.875: resized to 9 px, centre-cropped
    cfg = dict(eval_data_config('imagefolder', 1.0), input_size=(3, 8, 8))
    torch.testing.assert_close(_timm_eval_input(cfg, image), val[0][0])
    # --data-kwargs interpolation: the resize's resampling (DeiT and the public SOFT code evaluate bicubic)
    big = f'imagefolder:{tmp_path / "big"}'
    _, val_bicubic, _ = build_datasets(big, img_size=8, val_fraction=0.25, interpolation='bicubic')
    _, val_bilinear, _ = build_datasets(big, img_size=8, val_fraction=0.25)
    big_image = np.asarray(Image.open(val_bicubic.dataset.samples[val_bicubic.indices[0]][0]).convert('RGB'))
    cfg = dict(eval_data_config('imagefolder', None, 'bicubic'), input_size=(3, 8, 8))
    torch.testing.assert_close(_timm_eval_input(cfg, big_image), val_bicubic[0][0])
    assert not torch.allclose(val_bicubic[0][0], val_bilinear[0][0], atol=1e-3)
    model = nn.Linear(1, 1)
    record_training_data(model, {'name': 'imagefolder', 'num_classes': 2, 'in_chans': 3, 'img_size': 8,
                                 'crop_pct': 1.0, 'interpolation': 'bicubic'})
    assert (model.pretrained_cfg['crop_pct'], model.pretrained_cfg['interpolation']) == (1.0, 'bicubic')
    for key, bad in (('crop_pct', 0), ('crop_pct', 1.5), ('crop_pct', 'most'), ('interpolation', 'cubic')):
        with pytest.raises(ValueError, match=f'--data-kwargs {key}: expected '):
            build_datasets(spec, img_size=8, **{key: bad})


def test_crop_mode_squash_scores_a_non_square_image_as_the_public_finetune_py(tmp_path):
    """The public CRATE finetune.py scores Flowers and Pets through torchvision's Resize((224, 224)): the whole image,
    its aspect ratio not kept. crop_pct 1.0 alone centre-cropped a non-square image to its short side (a third of a
    3:2 image never seen); --data-kwargs crop_mode=squash is timm's name for the public transform, and the run's
    geometry reaches eval and export's pretrained_cfg like crop_pct's."""
    import torch.nn as nn
    from PIL import Image
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from torchvision import transforms as T

    from structformer.data.pixel_stats import eval_data_config
    from structformer.train.checkpoint import record_training_data
    rng = np.random.default_rng(7)
    for c in ('cat', 'dog'):
        (tmp_path / 'wide' / c).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (12, 18, 3), dtype=np.uint8)).save(tmp_path / 'wide' / c / f'{i}.png')
    spec = f'imagefolder:{tmp_path / "wide"}'
    _, squashed, _ = build_datasets(spec, img_size=8, val_fraction=0.25, crop_pct=1.0, crop_mode='squash')
    _, cropped, _ = build_datasets(spec, img_size=8, val_fraction=0.25, crop_pct=1.0)
    image = Image.open(squashed.dataset.samples[squashed.indices[0]][0]).convert('RGB')
    public = T.Compose([T.Resize((8, 8)), T.ToTensor(), T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
    torch.testing.assert_close(squashed[0][0], public(image))
    assert not torch.allclose(cropped[0][0], public(image), atol=1e-2)          # the short side's square only
    model = nn.Linear(1, 1)
    record_training_data(model, {'name': 'imagefolder', 'num_classes': 2, 'in_chans': 3, 'img_size': 8,
                                 'crop_pct': 1.0, 'crop_mode': 'squash'})
    assert model.pretrained_cfg['crop_mode'] == 'squash'
    torch.testing.assert_close(_timm_eval_input(dict(model.pretrained_cfg), np.asarray(image)), squashed[0][0])
    assert eval_data_config('imagefolder')['crop_mode'] == 'center'
    with pytest.raises(ValueError, match='--data-kwargs crop_mode: expected '):
        build_datasets(spec, img_size=8, crop_mode='stretch')


# ----- the --data argument and its errors -----

def test_parse_data_spec_and_forms():
    assert parse_data_spec('digits') == ('digits', None)
    assert parse_data_spec('MNIST:/a:b') == ('mnist', '/a:b')
    assert list(DATASET_FORMS) == ['digits', 'synthetic-subspaces', 'mnist:PATH', 'cifar10:PATH',
                                   'imagefolder:PATH', 'wds:TRAIN[,VAL]', 'hfds:PATH', 'imagenet:PATH', 'pysource',
                                   'text:PATH']


def test_unknown_dataset_lists_accepted_forms():
    with pytest.raises(ValueError, match='--data.*places365.*digits, synthetic-subspaces, mnist:PATH'):
        build_datasets('places365')
    with pytest.raises(ValueError, match='needs a folder'):
        build_datasets('mnist')
    with pytest.raises(ValueError, match='takes no path'):
        build_datasets('digits:/tmp')


def test_missing_path_names_path_and_argument(tmp_path):
    missing = str(tmp_path / 'nope')
    for form in ('mnist', 'cifar10', 'imagefolder'):
        with pytest.raises(FileNotFoundError, match=f"--data.*{re.escape(missing)}.*does not exist"):
            build_datasets(f'{form}:{missing}')


@pytest.mark.parametrize('kwargs, named', [
    (dict(token_dim=15), 'token_dim.*perfect square'),
    (dict(num_tokens='10'), 'num_tokens.*perfect square'),
    (dict(purity=1.5), r'purity.*\[0, 1\]'),
    (dict(noise=-1), 'noise.*>= 0'),
    (dict(num_classes='four'), 'num_classes.*integer'),
    (dict(num_classes=2.5), 'num_classes.*integer'),
    (dict(subspace_dim=17), 'subspace_dim.*token_dim'),
    (dict(augment=True), 'augment'),
    (dict(colour='red'), 'unknown option.*colour.*accepted options.*num_classes'),
    (dict(val_fraction=0), r'val_fraction.*\(0, 1\)'),
    (dict(val_fraction='1.2'), r'val_fraction.*\(0, 1\)'),
])
def test_bad_options_name_the_option(kwargs, named):
    with pytest.raises(ValueError, match=named):
        build_datasets('synthetic-subspaces', num_samples=40, **kwargs)


def test_string_options_are_coerced():
    train, val, info = build_datasets('synthetic-subspaces', num_classes='3', subspace_dim='2', token_dim='9',
                                      num_tokens='4', num_samples='60', noise='0.1', purity='1',
                                      val_fraction='0.5')
    assert (info.num_classes, info.img_size, info.extra['patch_size'], len(train), len(val)) == (3, 6, 3, 30, 30)
    assert info.extra['subspace_bases'].shape == (3, 9, 2)
    with pytest.raises(ValueError, match='augment.*true or false'):
        build_datasets('digits', augment='maybe')


def test_a_stratified_split_too_small_for_the_classes_names_the_fractions_that_fit():
    """30 samples of 10 classes at 0.2 hold out 6: one line naming --val-fraction and the range where every class has
    a sample on both sides (sklearn's message alone named neither)."""
    import numpy as np

    from structformer.data.tensor import stratified_split
    from structformer.errors import UsageError
    labels = np.repeat(np.arange(10), 3)
    with pytest.raises(UsageError, match=r'--val-fraction 0\.2: .*in \[0\.34, 0\.66\]'):
        stratified_split(labels, 0.2, 0)
    for fraction in (0.34, 0.66):
        train, val = stratified_split(labels, fraction, 0)
        assert set(labels[train]) == set(labels[val]) == set(range(10))


def test_imagefolder_val_lacking_a_train_class_is_labelled_by_train_index(tmp_path):
    # val/ without one of train/'s class folders (a class with no held-out images): labelled by train/'s index, as
    # imagenet:PATH does; it was refused as 'different class folders'
    _write_pngs(tmp_path / 'tv' / 'train', classes=('ant', 'bee', 'cat'), per_class=2)
    _write_pngs(tmp_path / 'tv' / 'val', classes=('ant', 'cat'), per_class=2)
    train, val, info = build_datasets(f'imagefolder:{tmp_path / "tv"}', img_size=8)
    assert info.num_classes == 3 and info.extra['classes'] == ['ant', 'bee', 'cat']
    assert sorted(val[i][1] for i in range(len(val))) == [0, 0, 2, 2]
    assert [os.path.basename(os.path.dirname(p)) for p, _ in val.samples] == ['ant', 'ant', 'cat', 'cat']
    assert val.targets == [0, 0, 2, 2] and val.classes == train.classes
    # one held-out class is a legal val/ too (train/ has the classes)
    _write_pngs(tmp_path / 'one' / 'train', classes=('ant', 'bee'), per_class=2)
    _write_pngs(tmp_path / 'one' / 'val', classes=('bee',), per_class=2)
    _, val, info = build_datasets(f'imagefolder:{tmp_path / "one"}', img_size=8)
    assert [val[i][1] for i in range(len(val))] == [1, 1] and info.num_classes == 2


def test_imagefolder_val_class_that_train_lacks_is_refused(tmp_path):
    from structformer.errors import UsageError
    _write_pngs(tmp_path / 'tv' / 'train', classes=('ant', 'bee'), per_class=2)
    _write_pngs(tmp_path / 'tv' / 'val', classes=('ant', 'wasp'), per_class=2)
    with pytest.raises(UsageError, match=r"--data .*val/ holds class folder 'wasp'.*train/ lacks"):
        build_datasets(f'imagefolder:{tmp_path / "tv"}', img_size=8)
