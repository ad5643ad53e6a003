"""`--format hf`: a folder in timm's Hugging Face layout, as `timm.models.push_to_hf_hub` uploads it.

    config.json         architecture, num_classes, num_features, global_pool, model_args, pretrained_cfg (timm's
                        `save_config_for_hf`: the input size and normalisation the run trained with), and
                        label_names / label_descriptions: the class names of the run's data, in its order
    model.safetensors   the weights (timm's `save_for_hf`, safe serialisation only: no pickle)
    README.md           model card: model, data, recipe, metrics (the run's summary.json), paper (timm's
                        `generate_readme` layout)

`timm.create_model('local-dir:FOLDER', pretrained=True)` reads this layout; uploading it is
`huggingface_hub.upload_folder(repo_id=..., folder_path=FOLDER)` (network and a token needed; docs/export.md).
A model built with recorded transforms (`factorize`, `sparsify`, ...) is refused: timm's config.json has no place
for them, so `local-dir:` would build another architecture than the weights'.
"""
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..errors import UsageError

__all__ = ['save_hf_folder', 'model_card', 'papers_of']

# transforms that do not change what timm's builder makes (a lazily shaped model materialised at build time)
_NEUTRAL_TRANSFORMS = ('materialize_lazy',)

PAPERS = {
    'crate': ('CRATE: White-Box Transformers via Sparse Rate Reduction (Yu et al., 2023, arXiv 2306.01129)',
              '@article{yu2023whitebox,\n  title={White-Box Transformers via Sparse Rate Reduction},\n'
              '  author={Yu, Yaodong and others},\n  journal={arXiv preprint arXiv:2306.01129},\n  year={2023}\n}'),
    'soft': ('SOFT: Softmax-free Linear Transformers (Lu et al., IJCV 2024, arXiv 2207.03341)',
             '@article{lu2024soft,\n  title={Softmax-free Linear Transformers},\n  author={Lu, Jiachen and others},\n'
             '  journal={International Journal of Computer Vision},\n  year={2024},\n  note={arXiv:2207.03341}\n}'),
    'sparsifiner': ('Sparsifiner: Learning Sparse Instance-Dependent Attention for Efficient Vision Transformers '
                    '(Wei et al., CVPR 2023, arXiv 2303.13755)',
                    '@inproceedings{wei2023sparsifiner,\n  title={Sparsifiner: Learning Sparse Instance-Dependent '
                    'Attention for Efficient Vision Transformers},\n  author={Wei, Cong and others},\n'
                    '  booktitle={CVPR},\n  year={2023}\n}'),
    'mixer': ('Understanding MLP-Mixer as a Wide and Sparse MLP (Hayase and Karakida, ICML 2024, arXiv 2306.01470)',
              '@inproceedings{hayase2024mixer,\n  title={Understanding MLP-Mixer as a Wide and Sparse MLP},\n'
              '  author={Hayase, Tomohiro and Karakida, Ryo},\n  booktitle={ICML},\n  year={2024}\n}'),
    'lowrank': ('Exploring Low Rank Training of Deep Neural Networks (Kamalakara et al., 2022, arXiv 2209.13569)',
                '@article{kamalakara2022lowrank,\n  title={Exploring Low Rank Training of Deep Neural Networks},\n'
                '  author={Kamalakara, Siddhartha Rao and others},\n  journal={arXiv preprint arXiv:2209.13569},\n'
                '  year={2022}\n}'),
}


def papers_of(model: torch.nn.Module) -> List[str]:
    """Keys of `PAPERS` whose method the model uses (by its classes and layers)."""
    from ..layers.attention.sparsifiner import SparsifinerAttention
    from ..layers.linear.factorized import FACTORIZED_TYPES
    from ..models.crate import CRATE
    from ..models.mixer import SWMLP, SparseMixer
    from ..models.soft import SoftNet
    found = []
    for key, hit in (('crate', lambda m: isinstance(m, CRATE)), ('soft', lambda m: isinstance(m, SoftNet)),
                     ('sparsifiner', lambda m: isinstance(m, SparsifinerAttention)),
                     ('mixer', lambda m: isinstance(m, (SparseMixer, SWMLP))),
                     ('lowrank', lambda m: isinstance(m, FACTORIZED_TYPES))):
        if any(hit(m) for m in model.modules()):
            found.append(key)
    return found


def _run_folder(checkpoint: Path) -> Optional[Path]:
    """RUN for RUN/checkpoints/epoch_NNNN (None for a checkpoint folder elsewhere)."""
    if checkpoint.parent.name == 'checkpoints':
        return checkpoint.parent.parent
    return None


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _recipe_lines(config: Dict[str, Any]) -> Dict[str, Any]:
    keys = ('epochs', 'batch_size', 'opt', 'lr', 'weight_decay', 'sched', 'warmup_epochs', 'amp', 'mixup', 'cutmix',
            'smoothing', 'model_ema', 'seed', 'transforms', 'teacher', 'recipe')
    return {k: config[k] for k in keys if config.get(k) not in (None, [], {}, '')}


def model_card(model: torch.nn.Module, state: Dict[str, Any], name: str) -> str:
    """README.md for the folder: timm's `generate_readme` with the model, data, recipe, metrics and papers."""
    from timm.models._hub import generate_readme

    from .source import weights_origin
    checkpoint = Path(state['path'])
    run = _run_folder(checkpoint)
    summary = _read_json(run / 'summary.json') if run else {}
    config = state.get('config') or {}
    data = str(config.get('data') or summary.get('data') or 'unknown').split(':')[0]   # the name, not a local path
    cfg = getattr(model, 'pretrained_cfg', {}) or {}
    details = {
        'Model Type': 'Image classification' if not hasattr(model, 'vocab_size') else 'Language model (byte tokens)',
        'Architecture': f"{state['model']} ({type(model).__name__}), built by structformer",
        'Params (M)': round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        'Input': ('token ids, context ' + str(getattr(model, 'context', '?')) if hasattr(model, 'vocab_size')
                  else 'images ' + ' x '.join(str(v) for v in cfg.get('input_size') or ()) + ' (C x H x W)'),
        'Dataset': data,
        'Trained': f"epoch {state.get('epoch')} of the run ({checkpoint.name})",
    }
    origin = weights_origin(state)
    if origin:                                   # a weights folder: no run, no epoch, no data of ours
        del details['Dataset'], details['Trained']
        details['Weights'] = origin
        summary = {}                             # and no run's summary: 'Metrics' says none were recorded here
    recipe = _recipe_lines(config)
    if config.get('amp') and state.get('precision') in ('float16', 'bfloat16'):
        recipe['amp'] = f"{state['precision']} autocast, float32 weights"     # --amp alone names no dtype
    if recipe:
        details['Recipe'] = recipe
    metrics = {k: v for k, v in summary.items() if k.startswith(('final_', 'best_'))}
    details['Metrics'] = metrics or ('none recorded by structformer for these weights' if origin else
                                     'no summary.json beside the checkpoint (run not finished, or a lone checkpoint)')
    papers = papers_of(model)
    if papers:
        details['Papers'] = [PAPERS[p][0] for p in papers]
    language = hasattr(model, 'vocab_size')
    usage = ("```python\nimport structformer, timm  # structformer registers the architecture with timm\n"
             "model = timm.create_model('local-dir:PATH/TO/THIS/FOLDER', pretrained=True).eval()\n" +
             ("logits = model(token_ids)  # int64 [B, T], T <= the context; logits [B, T, vocabulary]\n```\n"
              if language else "config = timm.data.resolve_data_config({}, model=model)\n"
                               "transform = timm.data.create_transform(**config)\n```\n"))
    # the Hub's task: a language model is no image classifier (timm's card defaults to one)
    task = 'text-generation' if language else 'image-classification'
    made = f"with weights {origin}" if origin else f"trained with `structformer train` on `{data}`"
    card = {'description': f"`{state['model']}` {made}, exported by `structformer export --format hf`.",
            'details': details, 'usage': usage, 'license': cfg.get('license', 'apache-2.0'),
            'tags': [task, 'timm', 'structformer'] + papers,
            'citation': [PAPERS[p][1] for p in papers]}
    if not papers:
        card.pop('citation')
    return generate_readme(card, state['model'], task_name=task)


def _check_timm_can_rebuild(state: Dict[str, Any]) -> None:
    """Refuse a model whose construction timm alone cannot repeat from config.json: `attn_layer='soft'` names a
    structformer layer that our factory resolves to its class (layers/attention/registry.py) and timm's ViT does not
    know ('Unknown attn_layer'); timm's writer then failed on the class ('Model argument attn_layer is not
    serializable', a traceback)."""
    from ..layers.attention.registry import ATTENTION_LAYERS
    kwargs = (state.get('recipe') or {}).get('kwargs') or state.get('model_kwargs') or {}
    name = kwargs.get('attn_layer')
    if isinstance(name, str) and name in ATTENTION_LAYERS:
        raise UsageError(f"--format hf: {state['model']} was built with attn_layer={name!r}, a structformer layer "
                         "that timm.create_model('local-dir:...') cannot build from config.json; use --format onnx "
                         "or --format torch-export")


def save_hf_folder(model: torch.nn.Module, state: Dict[str, Any], folder) -> Path:
    """Write config.json, model.safetensors and README.md into `folder` (an existing, empty folder: the caller
    writes into a temporary one and renames it into place)."""
    from timm.models._hub import save_for_hf
    transforms = [t.get('name') for t in (state.get('recipe') or {}).get('transforms') or []
                  if t.get('name') not in _NEUTRAL_TRANSFORMS]
    if transforms:
        raise UsageError(f"--format hf: {state['model']} was built with the model transform(s) {', '.join(transforms)}, "
                         "which timm's config.json cannot express (timm.create_model('local-dir:...') would build "
                         "the untransformed model); use --format onnx or --format torch-export")
    _check_timm_can_rebuild(state)
    folder = Path(folder)
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    labels = {key: cfg[key] for key in ('label_names', 'label_descriptions') if cfg.get(key)}
    try:
        save_for_hf(model, folder, safe_serialization=True, model_config=labels or None)
    except ValueError as e:          # timm: 'Model argument X is not serializable' (a class or function given)
        if 'not serializable' not in str(e):
            raise
        raise UsageError(f"--format hf: {state['model']} was built with an argument timm's config.json cannot hold "
                         f"({e}); use --format onnx or --format torch-export") from None
    (folder / 'README.md').write_text(model_card(model, state, state['model']))
    return folder
