"""What every structformer model family shares: timm's classifier interface, pooling, gradient
checkpointing, feature extraction, and the `_cfg` / create boilerplate of a timm model file.

A family subclasses `StructuredModel`, sets `head`, `num_features`, `global_pool`, `num_prefix_tokens`
and `no_weight_decay_names`, and writes `forward_features` / `forward_head` / `forward_intermediates`.
Each registered name stays an explicit `@register_model` function in the family's file, as in timm,
calling `create_model(cls, variant, pretrained, **kwargs)`.
"""
import functools
import logging
import pickle
import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, List, Optional, Set, Type, Union

import torch
from timm.layers import global_pool_nlc
from timm.models import build_model_with_cfg
from timm.models._features import feature_take_indices   # timm's own index rule for forward_intermediates
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data.pixel_stats import PIXEL_STATS

__all__ = ['StructuredModel', 'POOL_TYPES', 'check_global_pool', 'model_cfg', 'create_model',
           'check_pretrained_source', 'takes_token_ids', 'TOKEN_IDS_NOTE']

# timm's global_pool_nlc: the cls token, a reduction over the other tokens, or nothing; plus 'avg_all',
# the mean over every token, prefix tokens included (the official CRATE code's `pool='mean'`)
POOL_TYPES = ('token', 'avg', 'max', 'avgmax', 'avg_all', '')


def check_global_pool(global_pool: str) -> str:
    if global_pool not in POOL_TYPES:
        raise ValueError(f"global_pool={global_pool!r}: accepted {', '.join(repr(p) for p in POOL_TYPES)}")
    return global_pool


class StructuredModel(nn.Module):
    """timm's model interface (`get_classifier`, `reset_classifier`, `no_weight_decay`,
    `set_grad_checkpointing`) for token models with a linear head on pooled tokens."""
    global_pool: str = 'token'
    num_prefix_tokens: int = 1
    num_features: int
    head_hidden_size: int
    num_classes: int
    grad_checkpointing: bool = False
    no_weight_decay_names: Set[str] = frozenset()
    # the ModuleList whose outputs forward_intermediates returns ('blocks' for CRATE, 'stages' for SOFT)
    feature_modules: str = 'blocks'

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return set(self.no_weight_decay_names)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's parameter groups (`timm.models.group_parameters`, layer-wise lr decay in
        `create_optimizer_v2(..., layer_decay=...)`): the embeddings first ('stem': stem, patch / token
        embedding, cls and position tokens), then one group per block (per stage when `coarse`, a stage's
        downsampling with its first block, as timm's staged models), the final norm after the last block and
        the head last."""
        last = (r'^norm', (99999,))
        if self.feature_modules == 'stages':
            blocks = [(r'^stages\.(\d+)', None), last] if coarse else [
                (r'^stages\.(\d+)\.downsample', (0,)), (r'^stages\.(\d+)\.blocks\.(\d+)', None),
                (r'^stages\.(\d+)\.(\d+)', None), last]
        else:
            blocks = [(r'^blocks\.(\d+)', None), last]
        return dict(stem=r'^(?:stem|patch_embed|tok_embed|cls_token|pos_embed)', blocks=blocks)

    def declare_fixed_input_size(self, fixed: bool) -> None:
        """Tell timm whether this model takes only the image size it was built with (timm's `fixed_input_size`
        model trait, which `build_model_with_cfg` keeps when the model declares it). timm's
        `resolve_input_data_config` and `save_for_hf` read it: a flexible model gets the registry's example
        size, so a CRATE built with img_size=16 was handed (and exported with) 8 px images it refuses."""
        self._traits = dict(getattr(self, '_traits', None) or {}, fixed_input_size=bool(fixed))

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool)
        self.head = nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the feature modules after the last index taken (and the head / final norm), as timm's
        models do."""
        modules = getattr(self, self.feature_modules)
        take_indices, max_index = feature_take_indices(len(modules), indices)
        setattr(self, self.feature_modules, modules[:max_index + 1])
        info = getattr(self, 'feature_info', None)
        # only staged models change width along the depth (SW-MLP's map channels are not its flat width)
        width = info[max_index]['num_chs'] if info and self.feature_modules == 'stages' else self.num_features
        if width != self.num_features:
            # staged models narrow towards the input: the final norm (and a kept head) no longer fit, so the
            # norm goes whatever prune_norm says, as timm's staged models do when their last stage is cut
            if not prune_head:
                raise ValueError(f"prune_head=False keeps a head for {self.num_features} features, but the kept "
                                 f"{self.feature_modules} end at {width}; pass prune_head=True")
            prune_norm = True
            self.num_features = self.head_hidden_size = width
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [B, N, C] -> [B, C] by `global_pool` (timm's `global_pool_nlc`: 'avg' leaves the
        prefix tokens out; 'avg_all' keeps them)."""
        if self.global_pool == 'avg_all':
            return x.mean(dim=1)
        return global_pool_nlc(x, self.global_pool, self.num_prefix_tokens)

    def run_block(self, block: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
        """`block(x, *args)`, recomputed in backward instead of stored when grad checkpointing is on. The
        recomputation leaves BatchNorm's running statistics alone, so a checkpointed training step changes the
        model exactly as a plain one does (it updated them twice: momentum 0.19 instead of 0.1, two batches
        counted)."""
        if self.grad_checkpointing and not torch.jit.is_scripting() and torch.is_grad_enabled():
            if torch.compiler.is_compiling():     # dynamo traces no context_fn: timm's behaviour (updated twice)
                return checkpoint(block, x, *args, use_reentrant=False)
            return checkpoint(block, x, *args, use_reentrant=False,
                              context_fn=lambda: (nullcontext(), _running_statistics_kept(block)))
        return block(x, *args)

    def run_blocks_keeping(self, x: torch.Tensor, indices, norm: bool = False, stop_early: bool = False):
        """`self.blocks` on the embedded `x` (each through `run_block`), keeping the outputs of the blocks
        timm's `feature_take_indices` picks from `indices` (through `self.norm` when `norm`); `stop_early`
        skips the blocks after the last one kept. The loop of every single-stack `forward_intermediates`.
        Returns (the last block's output, the kept outputs)."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        kept = []
        for i, block in enumerate(blocks):
            x = self.run_block(block, x)
            if i in take_indices:
                kept.append(self.norm(x) if norm else x)
        return x, kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@contextmanager
def _running_statistics_kept(module: nn.Module):
    """BatchNorm buffers of `module` (running mean / variance, batches counted) as they were on entry, once the
    block exits: for a checkpointed block's recomputation, whose first forward already updated them. (Switching
    the tracking off instead changes what batch_norm saves for backward, which checkpointing refuses.)"""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    kept = [{name: buf.clone() for name, buf in m.named_buffers(recurse=False) if buf is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, kept):
                for name, value in buffers.items():
                    getattr(m, name).copy_(value)


def model_cfg(**kwargs) -> Dict[str, Any]:
    """A timm pretrained-config entry. Nothing is ever downloaded: `url` stays empty; `pretrained=True` loads what
    the user points the config at (`file`, `hf_hub_id`, or timm's `local-dir:` model names)."""
    return {'url': '', 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
            'crop_pct': 0.9, 'interpolation': 'bicubic', 'mean': (0.485, 0.456, 0.406),
            'std': (0.229, 0.224, 0.225), 'classifier': 'head', 'license': 'apache-2.0', **kwargs}


# the `notes` entry of a model that takes token ids [B, T] (int64), not images (the byte-level GPTs)
TOKEN_IDS_NOTE = 'input: token ids [B, T] (int64, a byte vocabulary 0-255), not images'


def takes_token_ids(cfg) -> bool:
    """Whether a pretrained config (timm's PretrainedCfg or its dict, or a model name) is a token-id model's:
    image tooling skips those."""
    if isinstance(cfg, str):
        import timm
        cfg = timm.get_pretrained_cfg(cfg)
    notes = (cfg.get('notes') if isinstance(cfg, dict) else getattr(cfg, 'notes', None)) or ()
    return TOKEN_IDS_NOTE in notes


# small-image settings: no crop, and the normalisation `structformer train` applies to the data the model is
# named for, in timm's pixel units (`data.pixel_stats`), so timm's transforms feed what training fed
SMALL_IMAGE_CFG = dict(mean=(0.,), std=(1.,), crop_pct=1.0, interpolation='nearest')   # synthetic: no image form
DIGITS_CFG = dict(SMALL_IMAGE_CFG, mean=PIXEL_STATS['digits'][0], std=PIXEL_STATS['digits'][1])
MNIST_CFG = dict(SMALL_IMAGE_CFG, mean=PIXEL_STATS['mnist'][0], std=PIXEL_STATS['mnist'][1])
CIFAR10_CFG = dict(crop_pct=1.0, mean=PIXEL_STATS['cifar10'][0], std=PIXEL_STATS['cifar10'][1])


NO_WEIGHTS = ("no pretrained weights are shipped and nothing downloads: pass pretrained_cfg_overlay=dict(file="
              "'weights.safetensors'), build timm.create_model('local-dir:DIR', pretrained=True) from a folder written by "
              "`structformer convert` or `export --format hf`, or train with --pretrained-path FILE")


def check_pretrained_source(variant: str, pretrained_cfg=None, pretrained_cfg_overlay=None) -> None:
    """Fail in one line, before building, when `pretrained=True` has nothing to load (timm's loader would fail
    deep inside, or, for a missing file, with an empty FileNotFoundError)."""
    from pathlib import Path

    from timm.models._builder import _resolve_pretrained_source, resolve_pretrained_cfg
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=pretrained_cfg_overlay)
    load_from, location = _resolve_pretrained_source(cfg.to_dict())
    if not load_from:
        raise ValueError(f"{variant}: pretrained=True: {NO_WEIGHTS}")
    if load_from in ('file', 'local-dir') and not Path(location).exists():
        raise FileNotFoundError(f"{variant}: pretrained weights {location}: does not exist")
    if load_from == 'file' and Path(location).is_dir():
        # timm's loader takes file= as a file: for a folder it raised a FileNotFoundError with no message at all
        inner = next((Path(location) / n for n in ('model.safetensors', 'pytorch_model.bin')
                      if (Path(location) / n).is_file()), None)
        raise IsADirectoryError(f"{variant}: pretrained weights {location}: is a folder; load it with "
                                f"timm.create_model('local-dir:{location}', pretrained=True), or give its weights file "
                                f"as file={' (' + str(inner) + ')' if inner else ''}")
    if load_from == 'file' and Path(location).is_file():
        from ..weights.file_kind import SAFETENSORS, sniff
        if sniff(location) != SAFETENSORS:
            # a web page saved by a failed download: timm's loader calls it 'non-allowlisted pickle globals' and
            # offers weights_only=False; said here as convert says it (numpy's .npz is a zip, passed on)
            from ..weights.torch_file import refuse_what_is_no_torch_file
            refuse_what_is_no_torch_file(Path(location), f"{variant}: pretrained weights")


def create_model(cls: Type[nn.Module], variant: str, pretrained: bool = False, default_out_indices=3,
                 feature_output_fmt: str = 'NCHW', **kwargs) -> nn.Module:
    """timm's `build_model_with_cfg` with feature extraction through `forward_intermediates`
    (`features_only=True`, `out_indices` default `default_out_indices`: an int takes the last n, at most
    `depth` of them; the maps in `feature_output_fmt`, timm's getter default NCHW, 'NLC' for a model with no
    grid, whose forward_intermediates refuses NCHW, so that features_only works for it). `pretrained=True` goes
    through timm's `load_pretrained` with the family's filter (`structformer.weights.filters`: classifier, input
    channels, position embeddings adapted, anything else that does not fit refused by name); with no weights
    configured it fails in one line naming what to pass. `device` / `dtype` (which timm.create_model hands every
    entry point; timm's own models build there): `device='meta'` builds on the meta device (under its device
    context: no weight is ever made, so a model of any size costs no memory, as timm's own models on 'meta'); any
    other device gets the model built on the CPU and moved, as `model.to(device, dtype)` would: our layers take no
    factory arguments, and building on the CPU keeps every initialiser (seeded masks and permutations drawn on the
    CPU) the same on every device."""
    placement = {k: kwargs.pop(k) for k in ('device', 'dtype') if kwargs.get(k) is not None}
    kwargs.pop('device', None), kwargs.pop('dtype', None)
    if placement:
        # the index vectors (permutations) are made on the CPU on purpose (layers/linear/permutation.py): the
        # final .to() moves those few integers to meta too
        on_meta = torch.device(placement['device']).type == 'meta' if 'device' in placement else False
        with torch.device('meta') if on_meta else nullcontext():
            model = create_model(cls, variant, pretrained, default_out_indices, feature_output_fmt, **kwargs)
        return model.to(**placement)
    if pretrained:
        check_pretrained_source(variant, kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay'))
    depth = kwargs.get('depth')
    if isinstance(default_out_indices, int) and isinstance(depth, int) and depth >= 1:
        # "the last n blocks" cannot ask for more blocks than a shallow variant has (timm asserts)
        default_out_indices = min(default_out_indices, depth)
    feature_cfg = dict(feature_cls='getter', out_indices=kwargs.pop('out_indices', default_out_indices),
                       output_fmt=feature_output_fmt)
    from ..weights.filters import pretrained_filter_fn
    # strictness is the filter's: it refuses by name whatever it does not adapt, and leaves out on purpose what
    # stays freshly initialised (a lazy Sparsifiner basis of another token count, shaped after loading)
    build = functools.partial(build_model_with_cfg, cls, variant, pretrained=pretrained, feature_cfg=feature_cfg,
                              pretrained_filter_fn=pretrained_filter_fn, pretrained_strict=False, **kwargs)
    if not pretrained:
        return _record_built_size(build(), kwargs)
    # timm's loader reads a torch file with weights_only=True and argparse.Namespace allowed; a trainer's checkpoint
    # may also hold paths or numpy scalars in it (convert and the training flags read those): the same allow-list
    from ..weights.torch_file import ALLOWED_GLOBALS
    builder_log = logging.getLogger('timm.models._builder')
    builder_log.addFilter(_adapted_first_layer_note)
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), warnings.catch_warnings():
            # torch asks the user to file an issue for a protocol other than 2; what it cannot read is named below
            warnings.filterwarnings('ignore', message='Detected pickle protocol')
            return _record_built_size(build(), kwargs)
    except (RuntimeError, pickle.UnpicklingError):
        _refuse_as_our_reader(variant, kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay'))
        raise
    finally:
        builder_log.removeFilter(_adapted_first_layer_note)


def _refuse_as_our_reader(variant: str, pretrained_cfg=None, pretrained_cfg_overlay=None) -> None:
    """After timm's loader failed on a torch file: our reader's one line if it refuses the file too. timm's words are
    'non-allowlisted pickle globals ... retry with weights_only=False' for a file of pickle protocol 4 (no global is
    involved) and name no global for a legacy-format file; convert's line says which and what to do. Only on failure:
    a file that loads is read once."""
    from pathlib import Path

    from timm.models._builder import _resolve_pretrained_source, resolve_pretrained_cfg

    from ..weights.file_kind import TORCH, sniff
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=pretrained_cfg_overlay)
    load_from, location = _resolve_pretrained_source(cfg.to_dict())
    if load_from == 'file' and sniff(location) == TORCH:
        from ..weights.torch_file import load_torch_file
        load_torch_file(Path(location), f"{variant}: pretrained weights")      # a UsageError where it refuses


def _adapted_first_layer_note(record: logging.LogRecord) -> bool:
    """False for timm's 'weights already match the model ... Loading unchanged' warning. Our filter adapts the first
    layer to the model's channels from the weights' own shape (and logs that it did) before timm's loader checks it
    against the registry's channel count, so timm then finds a fit and says the opposite of what happened."""
    return 'weights already match the model' not in record.getMessage()


def _record_built_size(model: nn.Module, kwargs) -> nn.Module:
    """The channels and image size `in_chans=` / `img_size=` built the model with, put into its `pretrained_cfg`
    (timm keeps the registry's there): timm's `resolve_data_config`, which its train.py, validate.py and
    inference.py call, reads the input size from there. timm's scripts pass in_chans=3 unless told, so a 1-channel
    model of ours (crate_digits) was built for RGB and then fed 1-channel images ('L', from the registry's size),
    and inference.py, which always reads RGB, could run none of them. A 1-value mean/std is repeated per channel,
    a 3-value one averaged for 1 channel (a 3-value Normalize broadcasts a grey image to 3 channels)."""
    cfg = getattr(model, 'pretrained_cfg', None)
    size = tuple((cfg or {}).get('input_size') or ())
    if len(size) != 3 or hasattr(model, 'vocab_size'):
        return model
    chans = kwargs.get('in_chans')
    chans = int(chans) if isinstance(chans, int) and chans >= 1 else size[0]
    img = kwargs.get('img_size')
    img = (img, img) if isinstance(img, int) else tuple(img) if isinstance(img, (tuple, list)) and len(img) == 2 \
        else size[1:]
    if (chans, *img) == size:
        return model
    cfg = dict(cfg, input_size=(chans, *(int(v) for v in img)))
    for key in ('mean', 'std'):
        stat = tuple(cfg.get(key) or ())
        if len(stat) == 1:
            cfg[key] = stat * chans
        elif stat and len(stat) != chans and chans == 1:
            cfg[key] = (sum(stat) / len(stat),)
    model.pretrained_cfg = cfg
    model.default_cfg = cfg                     # timm's older alias of the same dict
    return model
