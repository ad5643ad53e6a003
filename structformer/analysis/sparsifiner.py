"""`structformer analyze` on a model with Sparsifiner attention (Wei et al., CVPR 2023): accounting and pictures.

Per layer, on held-out images (numbers in sparsifiner.json, head-averaged and per head):
  mask density          share of True entries of the connectivity mask M (Eq. 3); B/n on every row the mask
                        sparsifies, 1 on the dense cls row (`dense_cls_row`)
  W_up sparsity         share of |W_up| < up_threshold (Eq. 3; the paper reports ≈ 90 %)
  Ã_down sparsity       share of low-rank coefficients Eq. 2 zeroes: ≤ τ (≈ 87 % in the paper, Fig. 7), or outside
                        each row's `coef_topk` largest when the layer keeps the top k (the public code's rule)
  attention recall      Σ_j M_ij·A_ij averaged over the sparsified query rows, A = softmax(QKᵀ/√d): the share
                        of the dense attention mass the mask keeps (a random mask of the same budget keeps B/n)
Pictures (PNG): the kept keys of one query patch per head over the image (the mask M, Eq. 3), the dense
attention row next to the sparse one Ã (Eq. 4–5; paper Fig. 5), and the rows of W_up as maps over the
patch grid, thresholded (paper Fig. 6). The mask is the layer's own (`keep_scores`, `impl='masked'`), the
dense attention and Ã_down are recomputed from the layer's input with its own projections.
Precision: the measurements run with autocast off (`full_precision`): the masks, densities and recalls of the
float32 model, whatever context they are called in.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from ..functional.precision import full_precision
from ..functional.sparsifiner import low_rank_attention, sparse_coefficients
from ..layers.attention.sparsifiner import SparsifinerAttention

__all__ = ['sparsifiner_layers', 'layer_maps', 'mask_density', 'attention_recall', 'w_up_sparsity',
           'a_down_sparsity', 'patch_grid', 'parse_query_patch', 'parse_layers', 'measure_sparsifiner',
           'run_sparsifiner_analysis']

PICTURE_IMAGES = 2          # sample images drawn (the first ones of the analysed set)
DEFAULT_LAYERS = 6          # layers drawn by default: the first six, as paper Fig. 6


def sparsifiner_layers(model: torch.nn.Module) -> Dict[str, SparsifinerAttention]:
    """{module name: layer} of every SparsifinerAttention, in model order (layer 1 first)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SparsifinerAttention)}


# ---------------------------------------------------------------- per-layer quantities (pure)

@full_precision
def layer_maps(attn: SparsifinerAttention, x: torch.Tensor, mask: torch.Tensor,
               with_a_down: bool = True) -> Dict[str, torch.Tensor]:
    """From the layer's input x [B, n, C] and its mask M [B, H, n, n]: the dense attention A = softmax(QKᵀ/√d),
    the sparse Ã = A restricted to M and renormalised (Eq. 4–5, what the masked softmax computes), and the
    low-rank coefficients A_down (Eq. 1, before the τ threshold of Eq. 2; not with `with_a_down=False`)."""
    q, k, _ = attn.project(x)
    dense = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    kept = dense * mask
    sparse = kept / kept.sum(-1, keepdim=True)
    if not with_a_down:
        return {'dense': dense, 'sparse': sparse, 'mask': mask}
    w_down, _ = attn.basis(k)
    if attn.predictor_q is not None:
        q, k = attn.predictor_q(q), attn.predictor_k(k)
    a_down = low_rank_attention(q, k, w_down.to(q.dtype), attn.logit_scale(q))
    return {'dense': dense, 'sparse': sparse, 'a_down': a_down, 'mask': mask}


def _layers_after_pruning(model: torch.nn.Module, layers: Dict[str, SparsifinerAttention]) -> set:
    """Names of the layers whose block sees tokens an earlier block pruned (last forward's bookkeeping). Not read
    from the token count: with EViT's fused token it can stay n (4 patches at keep 0.7: 3 kept + 1 fused)."""
    state = getattr(model, 'token_pruning', None)
    if state is None:
        return set()
    block_of = {id(getattr(block, 'attn', None)): i for i, block in enumerate(model.blocks)}
    return {name for name, attn in layers.items()
            if id(attn) in block_of and state.pruned_positions(block_of[id(attn)]) is not None}


def mask_density(mask: torch.Tensor, skip_rows: int = 0) -> torch.Tensor:
    """Share of kept connections per head, [H], over the query rows from `skip_rows` on."""
    return mask[..., skip_rows:, :].double().mean(dim=(0, 2, 3))


def attention_recall(dense: torch.Tensor, mask: torch.Tensor, skip_rows: int = 0) -> torch.Tensor:
    """Share of the dense attention mass inside the mask, [H]: mean over samples and query rows (from
    `skip_rows` on) of Σ_j M_ij·A_ij. Each row of A sums to 1, so this is kept mass over total mass."""
    return (dense * mask)[..., skip_rows:, :].sum(-1).mean(dim=(0, 2))


def w_up_sparsity(w_up: torch.Tensor, up_threshold: float) -> float:
    """Share of W_up entries that Eq. 3's threshold zeroes (|w| < up_threshold)."""
    return float((w_up.abs() < up_threshold).double().mean())


def a_down_sparsity(a_down: torch.Tensor, tau: float, coef_topk: Optional[int] = None) -> torch.Tensor:
    """Share of low-rank coefficients that Eq. 2 zeroes, per head [H]: A_down ≤ τ, or with `coef_topk` those outside
    each row's k largest (`sparse_coefficients`, the rule the layer applies; counting ≤ τ there reported the
    threshold a converted public model never uses)."""
    return (sparse_coefficients(a_down, tau, coef_topk) == 0).double().mean(dim=(0, 2, 3))


# ---------------------------------------------------------------- the patch grid and the flags

def patch_grid(model: torch.nn.Module, num_tokens: int) -> Tuple[int, int, int]:
    """(prefix tokens, grid rows, grid cols) of a ViT with `num_tokens` tokens."""
    prefix = int(getattr(model, 'num_prefix_tokens', 1))
    grid = getattr(getattr(model, 'patch_embed', None), 'grid_size', None)
    if grid is not None and grid[0] * grid[1] == num_tokens - prefix:
        return prefix, int(grid[0]), int(grid[1])
    side = math.isqrt(num_tokens - prefix)
    if side * side != num_tokens - prefix:
        raise ValueError(f"--checkpoint: the Sparsifiner pictures need a ViT's square patch grid; "
                         f"{num_tokens} tokens with {prefix} prefix tokens are not one")
    return prefix, side, side


def parse_query_patch(spec: Optional[str], rows: int, cols: int) -> Tuple[int, int]:
    """'ROW,COL' or a row-major patch index -> (row, col); None -> the centre patch."""
    if spec is None:
        return rows // 2, cols // 2
    accepted = (f"accepted ROW,COL with 0 <= ROW < {rows} and 0 <= COL < {cols}, or a patch index "
                f"0..{rows * cols - 1} (row-major; the cls token is not a patch)")
    text = spec.strip()
    m = re.fullmatch(r'(\d+)\s*,\s*(\d+)', text)
    if m:
        row, col = int(m.group(1)), int(m.group(2))
    elif re.fullmatch(r'\d+', text):
        row, col = divmod(int(text), cols)
    else:
        raise UsageError(f"--query-patch {spec}: {accepted}")
    if not (0 <= row < rows and 0 <= col < cols):
        raise UsageError(f"--query-patch {spec}: outside the {rows}x{cols} patch grid; {accepted}")
    return row, col


def parse_layers(specs: Optional[Sequence[str]], count: int) -> List[int]:
    """1-based layer numbers (the model's Sparsifiner layers in order); None -> the first six."""
    if not specs:
        return list(range(1, min(count, DEFAULT_LAYERS) + 1))
    chosen = []
    for spec in (s for item in specs for s in str(item).split(',') if s.strip()):
        if not re.fullmatch(r'\s*\d+\s*', spec) or not 1 <= int(spec) <= count:
            raise UsageError(f"--layers {spec}: accepted layer numbers 1..{count} (the model's "
                             f"Sparsifiner attention layers, in order)")
        if int(spec) not in chosen:
            chosen.append(int(spec))
    return chosen


# ---------------------------------------------------------------- measurement over a set of images

@contextmanager
def _recording(layers: Sequence[SparsifinerAttention]):
    """Each layer keeps its mask (`keep_scores`, masked path) for as long as the block lasts."""
    saved = [(m.keep_scores, m.impl) for m in layers]
    for m in layers:
        m.keep_scores, m.impl = True, 'masked'
    try:
        yield
    finally:
        for m, (keep, impl) in zip(layers, saved):
            m.keep_scores, m.impl = keep, impl
            m.last_scores = m.last_mask = None


@full_precision
def measure_sparsifiner(model: torch.nn.Module, images: torch.Tensor, query_token: Optional[int] = None,
                        draw: int = PICTURE_IMAGES, batch_size: int = 32) -> Dict:
    """Per-layer numbers over `images` and, for the first `draw` images, the rows of the query token
    `query_token` (default: the centre patch) of M, A and Ã [draw, H, n]. Returns {'layers': [...], 'rows': [...]}.
    A layer after token pruning (fewer tokens than W_up's columns) gets its density and recall on the tokens
    it sees, no Ã_down sparsity (its bases depend on which tokens were kept) and no rows (None)."""
    from ..hooks import capture
    from .whitebox import _eval_no_grad, _to_model
    layers = sparsifiner_layers(model)
    if not layers:
        raise ValueError("--checkpoint: the model has no SparsifinerAttention layer")
    images = _to_model(images, model)      # a float64 (or bf16) model takes the caller's float32 images
    sums: Dict[str, Dict[str, torch.Tensor]] = {name: {} for name in layers}
    rows: Dict[str, Dict[str, List[torch.Tensor]]] = {name: {'mask': [], 'dense': [], 'sparse': []} for name in layers}
    seen = 0
    # eval for the forwards, each module's own mode back after (measuring between training steps is no side effect)
    with _eval_no_grad(model), _recording(list(layers.values())):
        for start in range(0, len(images), batch_size):
            batch = images[start:start + batch_size]
            with capture(model, inputs=list(layers)) as got:
                model(batch)
            pruned_layers = _layers_after_pruning(model, layers)
            for name, attn in layers.items():
                x = got.inputs[name][0]
                n = x.shape[1]
                if query_token is None:
                    prefix, gh, gw = patch_grid(model, n)
                    query_token = prefix + (gh // 2) * gw + gw // 2
                mask = attn.last_mask
                if mask is None:
                    raise ValueError(f"{name}: the layer kept no mask (impl {attn.impl!r})")
                pruned = name in pruned_layers
                maps = layer_maps(attn, x, mask, with_a_down=not pruned)
                skip = 1 if attn.dense_cls_row else 0
                values = {'mask_density': mask_density(mask), 'mask_density_sparse_rows': mask_density(mask, skip),
                          'attention_recall': attention_recall(maps['dense'], mask, skip)}
                if not pruned:
                    values['a_down_sparsity'] = a_down_sparsity(maps['a_down'], attn.tau, attn.coef_topk)
                for key, v in values.items():
                    sums[name][key] = sums[name].get(key, 0) + v.double() * len(batch)
                if start < draw and not pruned:
                    for key in ('mask', 'dense', 'sparse'):
                        rows[name][key].append(maps[key][:draw - start, :, query_token].float())
                sums[name]['n'] = n
            seen += len(batch)
    out = []
    for i, (name, attn) in enumerate(layers.items()):
        n = sums[name].pop('n')
        keys, dense, token = attn.budget(n), int(attn.dense_cls_row), attn.connectivity == 'token'
        record = {'layer': i + 1, 'module': name, 'num_tokens': n, 'budget': keys, 'budget_fraction': keys / n,
                  'keep_ratio': attn.keep_ratio, 'connectivity': attn.connectivity,
                  'dense_cls_row': attn.dense_cls_row, 'tau': attn.tau, 'coef_topk': attn.coef_topk,
                  'up_threshold': attn.up_threshold,
                  'n_down': attn.basis.n_down,
                  'expected_mask_density': (n * n - (n - dense) * (n - keys)) / (n * n) if token else None,
                  'w_up_sparsity': w_up_sparsity(attn.basis.w_up.detach(), attn.up_threshold)}
        for key, total in sums[name].items():
            per_head = (total / seen).tolist()
            record[key] = sum(per_head) / len(per_head)
            record[key + '_per_head'] = per_head
        record.setdefault('a_down_sparsity', None)
        out.append(record)
    return {'layers': out, 'query_token': query_token,
            'rows': [{k: torch.cat(v) for k, v in rows[name].items()} if rows[name]['mask'] else None
                     for name in layers]}


# ---------------------------------------------------------------- pictures

def _grey(image: torch.Tensor) -> torch.Tensor:
    g = image.float().mean(0)
    return (g - g.min()) / (g.max() - g.min()).clamp_min(1e-12)


def _grid_map(row: torch.Tensor, prefix: int, gh: int, gw: int) -> torch.Tensor:
    return row[prefix:].reshape(gh, gw)


def plot_masks(image, rows, layers, query, grid, path: Path, title: str) -> bool:
    """The kept keys (M's query row, Eq. 3) of patch `query` per head (columns) and layer (rows), over the image."""
    from ..records import write_png
    prefix, gh, gw = grid

    def draw(plt):
        from matplotlib.patches import Rectangle
        heads = rows[0]['mask'].shape[0]
        fig, axes = plt.subplots(len(layers), heads, figsize=(1.7 * heads, 1.8 * len(layers)), squeeze=False)
        for r, (layer, row) in enumerate(zip(layers, rows)):
            for h in range(heads):
                ax = axes[r][h]
                kept = row['mask'][h]
                ax.imshow(_grey(image).numpy(), cmap='gray', extent=(0, gw, gh, 0), interpolation='nearest')
                overlay = torch.zeros(gh, gw, 4)
                overlay[..., 0], overlay[..., 3] = 1.0, 0.55 * _grid_map(kept, prefix, gh, gw)
                ax.imshow(overlay.numpy(), extent=(0, gw, gh, 0), interpolation='nearest')
                ax.add_patch(Rectangle((query[1], query[0]), 1, 1, fill=False, edgecolor='cyan', linewidth=2))
                cls = ' +cls' if prefix and bool(kept[:prefix].any()) else ''
                ax.set_title(f'L{layer} h{h + 1}: {int(kept[prefix:].sum())} patches{cls}', fontsize=7)
                ax.set_xticks([]), ax.set_yticks([])
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        return fig
    return write_png(path, draw)


def plot_attention(rows, layers, query, grid, path: Path, title: str) -> bool:
    """Paper Fig. 5: the query's dense attention row softmax(QKᵀ/√d) above its sparse row Ã (Eq. 4), per head,
    as maps over the patch grid (cls column dropped; its weight and each panel's colour maximum in the title)."""
    from ..records import write_png
    prefix, gh, gw = grid

    def draw(plt):
        heads = rows[0]['dense'].shape[0]
        fig, axes = plt.subplots(2 * len(layers), heads, figsize=(1.7 * heads, 1.7 * 2 * len(layers)), squeeze=False)
        for r, (layer, row) in enumerate(zip(layers, rows)):
            for h in range(heads):
                for j, kind in enumerate(('dense', 'sparse')):
                    ax, values = axes[2 * r + j][h], _grid_map(row[kind][h], prefix, gh, gw)
                    ax.imshow(values.numpy(), cmap='viridis', vmin=0, interpolation='nearest')
                    ax.plot([query[1]], [query[0]], marker='+', color='red')
                    cls = f' cls {float(row[kind][h, :prefix].sum()):.2f}' if prefix else ''
                    ax.set_title(f"L{layer} h{h + 1} {'A' if kind == 'dense' else 'Ã'} max {float(values.max()):.2f}"
                                 f"{cls}", fontsize=7)
                    ax.set_xticks([]), ax.set_yticks([])
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        return fig
    return write_png(path, draw)


def plot_basis(w_up: torch.Tensor, up_threshold: float, grid, path: Path, title: str) -> bool:
    """Paper Fig. 6: each of the n_down rows of W_up as a map over the patch grid (prefix columns dropped),
    entries with |w| < up_threshold set to zero (white)."""
    from ..records import write_png
    prefix, gh, gw = grid
    basis = (w_up * (w_up.abs() >= up_threshold))[:, prefix:].reshape(-1, gh, gw)
    vmax = float(basis.abs().max().clamp_min(1e-12))

    def draw(plt):
        cols = min(8, len(basis))
        nrows = math.ceil(len(basis) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(1.3 * cols, 1.4 * nrows + 0.4), squeeze=False)
        for i, ax in enumerate(axes.flat):
            ax.set_xticks([]), ax.set_yticks([])
            if i < len(basis):
                ax.imshow(basis[i].numpy(), cmap='RdBu_r', vmin=-vmax, vmax=vmax, interpolation='nearest')
                ax.set_title(f'row {i + 1}', fontsize=7)
            else:
                ax.axis('off')
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        return fig
    return write_png(path, draw)


# ---------------------------------------------------------------- `structformer analyze` entry

def run_sparsifiner_analysis(args, model, state: Dict, path: Path, out: Path, load_samples) -> int:
    """Measure and draw (see the module docstring) into `out`: sparsifiner.json and the PNGs."""
    from ..records import write_json
    layers = sparsifiner_layers(model)
    chosen = parse_layers(getattr(args, 'layers', None), len(layers))
    from .samples import check_takes_images, recorded_data
    spec, options, data_seed, val_fraction = recorded_data(state, args.data, path)
    images, _, idx = load_samples(spec, options, data_seed, val_fraction, args.num_samples, args.seed)
    # data the model cannot take: one line naming --data (it was a traceback from inside the patch embedding)
    check_takes_images(spec, images, path, model, state)
    grid = patch_grid(model, next(iter(layers.values())).basis.seq_len)    # W_up has one column per token
    query = parse_query_patch(getattr(args, 'query_patch', None), grid[1], grid[2])
    token = grid[0] + query[0] * grid[2] + query[1]
    result = measure_sparsifiner(model, images, token)
    out.mkdir(parents=True, exist_ok=True)
    name, figures = state.get('model') or type(model).__name__, {}
    drawn = [i for i in chosen if result['rows'][i - 1] is not None]      # pruned layers have no grid
    if drawn != chosen:
        print(f"note: layers {sorted(set(chosen) - set(drawn))} see pruned tokens; their masks are not drawn")
    picked = [result['rows'][i - 1] for i in drawn]
    for j in range(min(PICTURE_IMAGES, len(images)) if drawn else 0):
        rows = [{k: v[j] for k, v in r.items()} for r in picked]
        where = f'sample {idx[j]}, query patch (row {query[0]}, col {query[1]})'
        f = out / f'sparsifiner_mask_{j}.png'
        if plot_masks(images[j], rows, drawn, query, grid, f, f'{name}: kept keys (Eq. 3), {where}'):
            figures[f.stem] = f.name
        f = out / f'sparsifiner_attention_{j}.png'
        if plot_attention(rows, drawn, query, grid, f, f'{name}: dense A vs sparse Ã (Fig. 5), {where}'):
            figures[f.stem] = f.name
    for i in chosen:
        rec, attn = result['layers'][i - 1], layers[result['layers'][i - 1]['module']]
        f = out / f'sparsifiner_wup_layer{i}.png'
        if plot_basis(attn.basis.w_up.detach().float(), attn.up_threshold, grid, f,
                      f"{name} layer {i}: W_up rows, |w| < {attn.up_threshold:g} zeroed "
                      f"({100 * rec['w_up_sparsity']:.1f} % zero; Fig. 6)"):
            figures[f.stem] = f.name
    record = {'checkpoint': str(path), 'model': name, 'epoch': state.get('epoch'), 'data': spec,
              'data_kwargs': options, 'num_samples': len(idx), 'sample_indices': idx, 'seed': args.seed,
              'weights': 'ema' if getattr(args, 'ema', False) else 'model',
              'grid': list(grid[1:]), 'prefix_tokens': grid[0],
              'query_patch': {'row': query[0], 'col': query[1], 'index': query[0] * grid[2] + query[1],
                              'token': token},
              'layers_drawn': chosen, 'layers': result['layers'], 'figures': figures}
    json_path = write_json(out / 'sparsifiner.json', record)
    print(f"Sparsifiner {name}: {len(idx)} samples of {spec}, query patch (row {query[0]}, col {query[1]})")
    print('layer  density  sparse rows  B/n    recall  W_up zero  Ã_down zero')
    for r in result['layers']:
        print(f"{r['layer']:>5}  {r['mask_density']:.3f}    {r['mask_density_sparse_rows']:.3f}        "
              f"{r['budget_fraction']:.3f}  {r['attention_recall']:.3f}   {r['w_up_sparsity']:.3f}      "
              + ('-' if r['a_down_sparsity'] is None else f"{r['a_down_sparsity']:.3f}"))
    print(f'analysis: {json_path}')
    for f in figures.values():
        print(f'figure:   {out / f}')
    return 0
