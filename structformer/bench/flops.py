"""FLOP counts for the attention benchmark: measured by `FlopCounterMode`, and analytic.

Conventions (so the columns can be compared):
* FLOPs, with one multiply-add = 2 FLOPs, which is what `torch.utils.flop_counter` counts. It
  counts matmul / conv ops only: exp, softmax, norms and element-wise ops are missing from it.
* "core" = the layer minus its `nn.Linear` projections (qkv, proj), whose cost 2·n·in·out per call
  is exact and the same for every attention, so the attention mechanisms themselves are compared.
  SOFT's default path folds its value and output projections into the attention products
  (`soft_attention_projected`), so for SOFT "core" is the cost beyond an ordinary qkv/proj
  budget rather than a separate tally of attention ops; its "counted" total is what it runs.
* The analytic SOFT count is the paper's time complexity (SOFT §3, "Complexity") read with unit
  constants, per head: (d_e + 4 m d_e + m²)·n + T·m³ + d_e·m² multiply-adds. It is an order
  estimate, not an operation-by-operation tally (e.g. one Newton step, Eq. 10, is two m×m
  products, 2m³ multiply-adds, where the formula charges m³).
"""
from typing import Optional

import torch
from torch import nn
from torch.utils import flop_counter as torch_flops
from torch.utils.flop_counter import FlopCounterMode

SOFT_FORMULA = '2·h·[(d_e + 4·m·d_e + m²)·n + T·m³ + d_e·m²]  (SOFT §3 complexity, unit constants)'
SOFTMAX_FORMULA = '2·h·(2·n²·d_e)  (QKᵀ and AV, n²·d_e multiply-adds each)'


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return torch_flops.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                             **kwargs) -> int:
    return torch_flops.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's counter has formulas for SDPA's CUDA kernels (flash, efficient, cuDNN) but none for its CPU kernel, so a
# fused attention on the CPU counted as 0 (CRATE's MSSA, which has no `fused` switch, lost QKᵀ and AV): the same
# formulas, given for the CPU kernel here rather than in torch's global registry (causal masks are counted in full,
# as torch counts them on CUDA). The project's own custom ops register their formulas where they are defined
# (functional/shared_qkv_attention.py, functional/onednn_linear.py).
CPU_SDPA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode (matmul / conv FLOPs, multiply-add = 2), silent, with SDPA's CPU kernel counted. Every
    count in the benchmarks, `models --flops` and `compare` goes through it."""
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FORMULAS)


def linear_flops(layer: nn.Module, tokens: int, batch: int = 1) -> int:
    """Forward FLOPs of every nn.Linear in `layer` applied once to `batch`×`tokens` rows."""
    return sum(2 * batch * tokens * m.in_features * m.out_features
               for m in layer.modules() if isinstance(m, nn.Linear))


def soft_flops(tokens: int, landmarks: int, head_dim: int, heads: int, newton_iter: int) -> int:
    """Analytic SOFT forward FLOPs (module docstring): the paper's O(·) with unit constants, ×2."""
    n, m, d = tokens, landmarks, head_dim
    return 2 * heads * ((d + 4 * m * d + m * m) * n + newton_iter * m ** 3 + d * m * m)


def softmax_flops(tokens: int, head_dim: int, heads: int) -> int:
    """Analytic softmax-attention core FLOPs: QKᵀ and AV, each n²·d multiply-adds per head."""
    return heads * 2 * (2 * tokens * tokens * head_dim)


def analytic_core_flops(name: str, tokens: int, landmarks: int, head_dim: int, heads: int,
                        newton_iter: int = 20) -> Optional[dict]:
    """{'flops', 'formula'} for attentions with a closed form here (softmax family, SOFT family), else None."""
    if name in ('softmax', 'softmax_naive'):
        return {'flops': softmax_flops(tokens, head_dim, heads), 'formula': SOFTMAX_FORMULA}
    if name in ('soft', 'softpp'):
        return {'flops': soft_flops(tokens, landmarks, head_dim, heads, newton_iter), 'formula': SOFT_FORMULA}
    return None


def counted_flops(layer: nn.Module, x: torch.Tensor, grid_size, backward: bool = False) -> int:
    """Total FLOPs that FlopCounterMode sees for one forward (and backward of out.sum() if asked)."""
    with flop_counter() as counter:
        if backward:
            layer(x, grid_size=grid_size).sum().backward()
        else:
            with torch.no_grad():
                layer(x, grid_size=grid_size)
    return counter.get_total_flops()


# components of a model's forward, found by the last name of a module path (first match wins)
COMPONENTS = ('stem', 'downsampling', 'attention', 'mlp', 'head')


# a Mixer's two MLPs (timm's MlpMixer names them so, and ours): its token-mixing MLP is an MLP, not attention
_MLP_NAMES = ('mlp', 'mlp_tokens', 'mlp_channels')


def _component(path: str, module: Optional[nn.Module] = None) -> Optional[str]:
    declared = getattr(module, 'flop_component', None)      # a module that says what it is (SW-MLP's block)
    if declared in COMPONENTS:
        return declared
    last = path.rsplit('.', 1)[-1]
    if path in ('stem', 'patch_embed', 'stages.0.downsample'):
        return 'stem'
    if last == 'downsample':
        return 'downsampling'
    if last in _MLP_NAMES:
        return 'mlp'
    if last in ('attn', 'head') and (last != 'head' or path == 'head'):
        return {'attn': 'attention'}.get(last, last)
    return None


def forward_flops(model: nn.Module, sample: torch.Tensor):
    """(FLOPs, the FlopCounterMode) of one forward of `sample` through a built `model` in eval mode, without
    gradients (`flop_counter`: SDPA's CPU kernel counted by torch's SDPA formula). Attention layers with a switch
    (`fused` / timm's `fused_attn`) are counted on their explicit, mathematically identical path, which has the
    same products, whichever SDPA backend would run, and switched back afterwards; the model's train / eval mode
    is restored too."""
    switched = []
    for mod in model.modules():
        for flag in ('fused', 'fused_attn'):
            if getattr(mod, flag, None) is True:
                setattr(mod, flag, False)
                switched.append((mod, flag))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), flop_counter() as counter:
            model(sample)
    finally:
        for mod, flag in switched:
            setattr(mod, flag, True)
        model.train(was_training)
    return counter.get_total_flops(), counter


def model_flops(name: str, img_size: Optional[int] = None, **kwargs) -> dict:
    """Parameters and forward FLOPs of one image (a language model: one sequence of its context length)
    through a registered model (eval mode, CPU).

    Returns {'params', 'effective_params' (a mask's kept weights), 'input_size', 'flops', 'macs', 'breakdown_macs': {component: MACs}}, with
    components stem / downsampling / attention / mlp / head / other (the rest: norms' matmul-free
    ops count 0, cls-token concat etc.). Papers, SOFT Table 1–2 included, quote multiply-adds as
    "FLOPs", so compare their numbers with `macs` = flops / 2 (module docstring). Fused softmax
    attention (SDPA) is counted as its QKᵀ and AV products (`forward_flops`).
    """
    import timm
    model = timm.create_model(name, **({'img_size': img_size} if img_size else {}), **kwargs).eval()
    cfg = timm.get_pretrained_cfg(name)
    chans, height, width = cfg.input_size if cfg else (3, 224, 224)
    chans = getattr(model, 'in_chans', chans)
    if img_size:
        height = width = img_size
    from ..models import list_structformer_language_models
    if name in list_structformer_language_models():      # one sequence of token ids, the full context
        chans, height, width = 1, 1, model.context
        sample = torch.zeros(1, width, dtype=torch.long)
    else:
        sample = torch.randn(1, chans, height, width)
    total, counter = forward_flops(model, sample)
    breakdown = dict.fromkeys(COMPONENTS, 0)
    modules = dict(model.named_modules())
    for key, ops in counter.get_flop_counts().items():
        path = key.split('.', 1)[1] if '.' in key else ''
        component = _component(path, modules.get(path)) if path else None
        if component:
            breakdown[component] += sum(ops.values()) / 2
    breakdown['other'] = total / 2 - sum(breakdown.values())
    from ..models.inventory import effective_parameter_count
    return {'params': sum(p.numel() for p in model.parameters()), 'effective_params': effective_parameter_count(model),
            'input_size': [chans, height, width],
            'flops': total, 'macs': total / 2, 'breakdown_macs': breakdown}


def row_forward_flops(row: dict) -> Optional[int]:
    """A sweep row's whole-layer forward FLOPs: as counted, or, where the counter missed the core (no
    FlopCounterMode formula for the attention kernel this device ran, e.g. SDPA's CPU kernel), its counted
    projections plus the analytic core. None where neither is known."""
    counted = row.get('flops_counted_forward')
    if counted is None:
        return None
    if row.get('flops_counter_missed'):
        analytic = row.get('flops_analytic_core_forward')
        return None if analytic is None else row.get('flops_linear_forward', 0) + analytic
    return counted
