"""Linear interpolation between two trained networks (seed 004, §4.3, Fig. 2, 4, 5).

θ(t) = (1 − t) θ_a + t θ_b for t in [0, 1], and the loss / accuracy of the network θ(t) on held-out
data. The seed compares a dense baseline with a low-rank model: their parameters live in different
spaces (W versus U, V), so both are first read as dense networks (`densify`: every factorised layer
becomes the nn.Linear / nn.Conv2d applying W = U Vᵀ) and the dense weights are interpolated. Every
floating-point entry of the state dict is interpolated, BatchNorm running statistics included (the
seed does not say otherwise); integer buffers (BN's batch counter) are taken from θ_a.

`structformer analyze --checkpoint A --interpolate B` writes interpolation.json and interpolation.png.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from torch import nn

from ..cli_args import MAX_INTERPOLATE_STEPS
from ..layers.linear.factorized import FactorizedConv2d, FactorizedLinear

__all__ = ['densify', 'interpolate_parameters', 'interpolation_curve', 'run_interpolation']


@torch.no_grad()
def densify(model: nn.Module) -> nn.Module:
    """A copy of `model` with every factorised layer replaced by the dense layer it applies."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, FactorizedLinear):
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=module.U.device, dtype=module.U.dtype)
        elif isinstance(module, FactorizedConv2d):
            dense = nn.Conv2d(module.in_channels, module.out_channels, module.kernel_size, stride=module.stride,
                              padding=module.padding, dilation=module.dilation, bias=module.bias is not None,
                              device=module.U.device, dtype=module.U.dtype)
        else:
            continue
        dense.weight.copy_(module.to_dense())
        if module.bias is not None:
            dense.bias.copy_(module.bias)
        parent_name, _, child = name.rpartition('.')
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
    return model


def interpolate_parameters(state_a: Dict[str, torch.Tensor], state_b: Dict[str, torch.Tensor],
                           t: float) -> Dict[str, torch.Tensor]:
    """(1 − t)·a + t·b for every floating tensor; other tensors from a. The keys and shapes must agree."""
    if state_a.keys() != state_b.keys():
        only = sorted(set(state_a) ^ set(state_b))[:4]
        raise ValueError(f"the two networks differ in their parameters (e.g. {', '.join(only)}); interpolation "
                         "needs the same architecture (factorised layers are read densely)")
    out = {}
    for key, a in state_a.items():
        b = state_b[key]
        if a.shape != b.shape:
            raise ValueError(f"parameter {key}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
        out[key] = torch.lerp(a, b.to(a.dtype), t) if a.is_floating_point() else a.clone()
    return out


def interpolation_curve(model_a: nn.Module, model_b: nn.Module, loader, ts: Sequence[float],
                        device='cpu') -> List[Dict[str, float]]:
    """Loss and accuracy (structformer.train.evaluate) of θ(t) for each t."""
    from ..train.engine import evaluate
    a, b = densify(model_a), densify(model_b)
    state_a, state_b = a.state_dict(), b.state_dict()
    probe = copy.deepcopy(a)
    rows = []
    for t in ts:
        probe.load_state_dict(interpolate_parameters(state_a, state_b, float(t)))
        rows.append({'t': float(t), **evaluate(probe, loader, device)})
    return rows


def run_interpolation(args, main_path: Path, out: Path) -> int:
    """`analyze --checkpoint A --interpolate B`: the curve on A's held-out split, as JSON and a plot."""
    from torch.utils.data import DataLoader

    from ..records import write_json, write_png
    from ..data import build_datasets
    from ..train.checkpoint import load_model
    from .samples import check_takes_images, load_named, recorded_data, second_checkpoint
    other = second_checkpoint('--interpolate', args.interpolate)
    if not 2 <= args.interpolate_steps <= MAX_INTERPOLATE_STEPS:       # the parser's range, for a Namespace built by hand
        raise ValueError(f"--interpolate-steps must be an integer in [2, {MAX_INTERPOLATE_STEPS}], got "
                         f"{args.interpolate_steps!r}")
    model_a, state_a = load_model(main_path, ema=args.ema)
    model_b, state_b = load_named('--interpolate', other, ema=args.ema)
    spec, options, data_seed, val_fraction = recorded_data(state_a, args.data, main_path)
    _, val, _ = build_datasets(spec, seed=data_seed, val_fraction=val_fraction, **options)
    if len(val):               # data a model cannot take: one line naming --data, not a traceback from inside timm
        batch = torch.stack([val[i][0] for i in range(min(2, len(val)))])
        check_takes_images(spec, batch, main_path, model_a, state_a, '--checkpoint')
        check_takes_images(spec, batch, other, model_b, state_b, '--interpolate')
    if len(val) > args.num_samples:
        val = torch.utils.data.Subset(val, torch.randperm(len(val), generator=torch.Generator().manual_seed(args.seed))
                                      [:args.num_samples].sort().values.tolist())
    ts = [i / (args.interpolate_steps - 1) for i in range(args.interpolate_steps)]
    rows = interpolation_curve(model_a, model_b, DataLoader(val, batch_size=256), ts)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / 'interpolation.json', {'a': str(main_path), 'b': str(other), 'data': spec, 'data_kwargs': options,
                                            'data_seed': data_seed, 'val_fraction': val_fraction,
                                            'seed': args.seed, 'weights': 'ema' if args.ema else 'model',
                                            'samples': len(val), 'curve': rows})

    def draw(plt):
        fig = plt.figure(figsize=(8, 3.2))
        ax1 = fig.add_subplot(1, 2, 1)
        ax1.plot(ts, [r['loss'] for r in rows], marker='o')
        ax1.set_xlabel('t  (θ = (1-t) θ_a + t θ_b)')
        ax1.set_ylabel('held-out loss')
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.plot(ts, [r['top1'] for r in rows], marker='o', color='C1')
        ax2.set_xlabel('t')
        ax2.set_ylabel('held-out top-1 (%)')
        fig.suptitle(f"a = {state_a.get('model')} epoch {state_a.get('epoch')}, "
                     f"b = {state_b.get('model')} epoch {state_b.get('epoch')}", fontsize=9)
        fig.tight_layout()
        return fig
    write_png(out / 'interpolation.png', draw)
    print(f"{'t':>5} {'loss':>9} {'top1':>7}")
    for r in rows:
        print(f"{r['t']:>5.2f} {r['loss']:>9.4f} {r['top1']:>6.2f}%")
    print(f"written: {out / 'interpolation.json'}, {out / 'interpolation.png'}")
    return 0
