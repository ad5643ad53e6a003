"""`structformer analyze --checkpoint A --cka B`: mini-batch CKA between every block output of two
checkpoints on A's held-out data. Any two models with `forward_intermediates` (every structformer model, timm
ViTs and Mixers) and the same input shape can be compared. `--cka-features branches` compares the residual
branches instead, Mixer paper Fig. 2's features (Mixers and SW-MLPs; `analysis.cka.branch_modules`).

Writes cka.json (the matrix, rows A's blocks, columns B's) and cka.png (its heat map) into --output.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..records import write_json, write_png


_MEANING = {'blocks': 'block outputs (after the residual add)',
            'branches': 'residual branches (before the skip connection)'}


def run_cka_analysis(args, main_path: Path, out: Path, load_samples) -> int:
    from ..errors import UsageError
    from ..train.checkpoint import load_model
    from .cka import branch_modules, minibatch_cka
    from .samples import check_takes_images, load_named, recorded_data, second_checkpoint
    other_path = second_checkpoint('--cka', args.cka)
    model_a, state_a = load_model(main_path, ema=args.ema)
    model_b, state_b = load_named('--cka', other_path, ema=args.ema)
    features = args.cka_features
    if features == 'branches':
        for flag, path, model, state in (('--checkpoint', main_path, model_a, state_a),
                                         ('--cka', other_path, model_b, state_b)):
            try:
                branch_modules(model)
            except ValueError as e:
                raise UsageError(f"--cka-features branches: {flag} {path} (model {state.get('model')!r}): {e}; "
                                 "accepted for Mixers and SW-MLPs, or --cka-features blocks") from None
    spec, options, data_seed, val_fraction = recorded_data(state_a, args.data, main_path)
    images, _, idx = load_samples(spec, options, data_seed, val_fraction, args.num_samples, args.seed)
    # data a model cannot take: one line naming --data (timm's patch embedding asserts, which the catch below missed)
    check_takes_images(spec, images, main_path, model_a, state_a, '--checkpoint')
    check_takes_images(spec, images, other_path, model_b, state_b, '--cka')
    if len(idx) < 4:
        raise ValueError(f"--cka: CKA's unbiased estimator needs at least 4 samples, and the validation split of "
                         f"{spec} has only {len(idx)}; pass --data with more held-out images")
    batch = max(4, min(args.cka_batch_size, len(idx)))
    batches = [images[i:i + batch] for i in range(0, len(idx), batch) if len(images[i:i + batch]) >= 4]
    try:
        result = minibatch_cka(model_a, model_b, batches, features)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--cka {args.cka}: the two models cannot read the same images ({str(e).splitlines()[0]})") from None
    cka = result['cka']
    name_a, name_b = state_a.get('model'), state_b.get('model')
    out.mkdir(parents=True, exist_ok=True)
    record = {'a': {'checkpoint': str(main_path), 'model': name_a, 'epoch': state_a.get('epoch')},
              'b': {'checkpoint': str(other_path), 'model': name_b, 'epoch': state_b.get('epoch')},
              'data': spec, 'data_kwargs': options, 'data_seed': data_seed, 'val_fraction': val_fraction,
              'seed': args.seed, 'weights': 'ema' if args.ema else 'model', 'sample_indices': idx[:sum(len(b) for b in batches)],
              'samples': sum(len(b) for b in batches), 'batch_size': batch,
              'estimator': 'minibatch linear CKA, unbiased HSIC (Nguyen et al. 2021)', 'features': features,
              'features_meaning': _MEANING[features], 'numbering': 'from 1, the input side first',
              # Fig. 2 (a)'s number: the mean of the diagonal, layer i of A against layer i of B (square only)
              'diagonal_mean': (float(cka.diagonal().mean()) if cka.shape[0] == cka.shape[1]
                                and not cka.diagonal().isnan().any() else None),
              'cka': [[None if math.isnan(v) else v for v in row] for row in cka.tolist()]}
    undefined = cka.isnan()
    if undefined.any():       # a self-HSIC of zero or below: a feature without variance over these samples
        record['undefined'] = ("null where a block's summed unbiased self-HSIC is zero or negative (no variance "
                               "over these samples): CKA is 0/0 there")
        print(f"note: CKA is undefined (null in cka.json) for {int(undefined.sum())} of {undefined.numel()} pairs: "
              "a block whose features have no variance over these samples (summed unbiased self-HSIC ≤ 0)")
    unit = 'block' if features == 'blocks' else 'branch'
    print(f"CKA between the {_MEANING[features]} of {name_a} ({main_path}) and {name_b} ({other_path}), "
          f"{record['samples']} samples of {spec} in batches of {batch} (rows A, columns B, numbered from 1):")
    print('      ' + ''.join(f"  B{j + 1:<4}" for j in range(cka.shape[1])))
    for i, row in enumerate(cka.tolist()):
        print(f"A{i + 1:<4} " + ''.join(f"  {v:5.3f}" for v in row))
    if record['diagonal_mean'] is not None:
        print(f"mean of the diagonal (Mixer paper Fig. 2 (a)): {record['diagonal_mean']:.4f}")
    print(f"wrote {write_json(out / 'cka.json', record)}")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(4.8, 4))
        rows, cols = cka.shape
        image = ax.imshow(cka.numpy(), vmin=0, vmax=1, cmap='magma', origin='lower', aspect='auto',
                          extent=(0.5, cols + 0.5, 0.5, rows + 0.5))      # ticks at 1 … L, as the paper's
        ax.set_xticks(range(1, cols + 1))
        ax.set_yticks(range(1, rows + 1))
        ax.set_xlabel(f'{name_b} {unit}')
        ax.set_ylabel(f'{name_a} {unit}')
        ax.set_title(f'mini-batch linear CKA of the\n{_MEANING[features]}', fontsize=8)
        fig.colorbar(image, ax=ax, label='CKA')
        fig.tight_layout()
        return fig
    if write_png(out / 'cka.png', draw):
        print(f"wrote {out / 'cka.png'}")
    return 0
