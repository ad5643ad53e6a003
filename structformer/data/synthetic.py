"""Tokens from a mixture of low-dimensional subspaces: the data model of CRATE (Yu et al., 2023, §2.2).

K subspaces of R^D with orthonormal bases B_k (D x p). A sample of class k is N tokens; each token
comes from subspace k with probability `purity`, otherwise from a uniformly chosen other subspace,
and is B_j g with g ~ N(0, I_p), plus isotropic noise `noise`·N(0, I_D). If K·p <= D the subspaces
are mutually orthogonal (QR of one D x Kp Gaussian matrix), otherwise independent random
orthonormal bases, which are incoherent with high probability.

The N tokens are laid out as the non-overlapping √D x √D patches (row-major) of one grey image of
side √N·√D, so a ViT patch embedding with patch_size=√D cuts the image back into exactly these tokens.
"""
import math

import torch
from einops import rearrange

from .augment import refuse_augmentation
from .spec import DatasetInfo, Option, is_square, resolve_options
from .tensor import split_datasets, stratified_split

OPTIONS = {
    'num_classes': Option(int, 4, 'an integer >= 2', lambda v: v >= 2),
    'subspace_dim': Option(int, 3, 'an integer >= 1 and <= token_dim', lambda v: v >= 1),
    'token_dim': Option(int, 16, 'a perfect square >= 1 (each token is a √D x √D patch)', is_square),
    'num_tokens': Option(int, 16, 'a perfect square >= 1 (tokens tile a √N x √N grid)', is_square),
    'num_samples': Option(int, 2000, 'an integer >= 4', lambda v: v >= 4),
    'noise': Option(float, 0.05, 'a finite number >= 0', lambda v: math.isfinite(v) and v >= 0),     # inf: NaN loss
    'purity': Option(float, 0.75, 'a number in [0, 1]', lambda v: 0 <= v <= 1),
    'augment': Option(bool, False, 'false (shifting or flipping would move tokens across patches)',
                      lambda v: not v),
}


def tokens_to_image(tokens: torch.Tensor) -> torch.Tensor:
    """[B, N, D] tokens -> [B, 1, √N·√D, √N·√D] image, token t = patch (t // √N, t % √N), row-major in-patch."""
    n, d = tokens.shape[-2:]
    return rearrange(tokens, 'b (h w) (p1 p2) -> b 1 (h p1) (w p2)', h=math.isqrt(n), p1=math.isqrt(d))


def image_to_tokens(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Inverse of tokens_to_image: what a ViT patch embedding (Conv2d stride=patch_size) sees per token."""
    return rearrange(images, 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)', p1=patch_size, p2=patch_size)


def random_subspace_bases(num_classes: int, dim: int, subspace_dim: int, gen: torch.Generator) -> torch.Tensor:
    """[K, D, p] orthonormal bases: mutually orthogonal if K·p <= D, else independent (incoherent w.h.p.)."""
    k, d, p = num_classes, dim, subspace_dim
    if k * p <= d:
        q, _ = torch.linalg.qr(torch.randn(d, k * p, generator=gen, dtype=torch.float64))
        bases = q.reshape(d, k, p).permute(1, 0, 2)
    else:
        bases, _ = torch.linalg.qr(torch.randn(k, d, p, generator=gen, dtype=torch.float64))
    return bases.float().contiguous()


def sample_tokens(bases: torch.Tensor, labels: torch.Tensor, num_tokens: int, purity: float, noise: float,
                  gen: torch.Generator):
    """Tokens [n, N, D] and the subspace each token came from [n, N] (CRATE §2.2 mixture of subspaces)."""
    k, d, p = bases.shape
    n = len(labels)
    own = torch.rand(n, num_tokens, generator=gen) < purity
    # An "other" subspace uniformly among the K-1 that are not the sample's class.
    offset = torch.randint(1, max(k, 2), (n, num_tokens), generator=gen)
    subspace = torch.where(own, labels[:, None], (labels[:, None] + offset) % k)
    coeffs = torch.randn(n, num_tokens, p, generator=gen)
    # Always drawn, so that samples with different `noise` differ only in the noise scale.
    eps = torch.randn(n, num_tokens, d, generator=gen)
    tokens = noise * eps
    for j in range(k):          # per subspace, to avoid an [n, N, D, p] gather of bases
        mask = subspace == j
        tokens[mask] += coeffs[mask] @ bases[j].T
    return tokens, subspace


def _check_memory(num_samples: int, num_tokens: int, token_dim: int, num_classes: int, subspace_dim: int) -> None:
    """Refuse sizes whose generated tensors cannot fit this machine's memory, before any is allocated (before:
    the allocator's traceback). Peak: the noise, the tokens and their image layout, float32 [n, N, D] each, and
    the float64 bases and their QR input."""
    from ..machine import check_fits_memory
    need = 3 * 4 * num_samples * num_tokens * token_dim + 2 * 8 * token_dim * num_classes * subspace_dim
    check_fits_memory(need, f"--data-kwargs num_samples={num_samples}, num_tokens={num_tokens}, token_dim={token_dim}, "
                            f"num_classes={num_classes}, subspace_dim={subspace_dim}: the generated data",
                      'give fewer or smaller samples')


def build_synthetic(*, seed, val_fraction, train_transform, eval_transform, augmentation=None, **options):
    # the pixels are tokens of subspaces: cropping, flipping or recolouring them would break the data model
    refuse_augmentation(augmentation, 'synthetic-subspaces')
    o = resolve_options('synthetic-subspaces', OPTIONS, options)
    k, p, d, n_tok = o['num_classes'], o['subspace_dim'], o['token_dim'], o['num_tokens']
    if p > d:
        raise ValueError(f'option subspace_dim: expected an integer >= 1 and <= token_dim={d}; got {p}')
    _check_memory(o['num_samples'], n_tok, d, k, p)
    gen = torch.Generator().manual_seed(int(seed))
    bases = random_subspace_bases(k, d, p, gen)
    labels = (torch.arange(o['num_samples']) % k)[torch.randperm(o['num_samples'], generator=gen)]
    tokens, subspace = sample_tokens(bases, labels, n_tok, o['purity'], o['noise'], gen)
    images = tokens_to_image(tokens)
    # Each coordinate of B g has variance p/D (B orthonormal) and the noise adds noise²: dividing by
    # that std gives unit-variance pixels; the mean is 0 by construction.
    token_std = math.sqrt(p / d + o['noise'] ** 2)
    train_idx, val_idx = stratified_split(labels.numpy(), val_fraction, seed)
    train, val = split_datasets(images, labels, train_idx, val_idx, mean=[0.0], std=[token_std],
                                train_transform=train_transform, eval_transform=eval_transform)
    train.token_subspaces, val.token_subspaces = subspace[train_idx], subspace[val_idx]
    orthogonal = k * p <= d
    patch, side = math.isqrt(d), math.isqrt(n_tok) * math.isqrt(d)
    info = DatasetInfo(
        name='synthetic-subspaces', num_classes=k, in_chans=1, img_size=side, train_size=len(train),
        val_size=len(val),
        description=(f"synthetic mixture of {k} {'orthogonal' if orthogonal else 'random (incoherent)'} "
                     f"{p}-dim subspaces of R^{d} (CRATE §2.2): {o['num_samples']} samples of {n_tok} tokens "
                     f"as {patch}x{patch} patches of {side}x{side} images, purity={o['purity']}, "
                     f"noise={o['noise']}, seed={seed}; stratified split {len(train)} train / {len(val)} val"),
        extra={'subspace_bases': bases, 'patch_size': patch, 'orthogonal': orthogonal, 'token_std': token_std,
               'mean': [0.0], 'std': [token_std], 'max_value': 1.0, 'seed': seed,
               **{key: o[key] for key in ('subspace_dim', 'token_dim', 'num_tokens', 'num_samples', 'noise',
                                          'purity')}})
    return train, val, info
