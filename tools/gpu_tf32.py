"""What TF32 would change on a GPU, measured: the question behind `structformer train` leaving TF32 matmuls and
`cudnn.benchmark` off where timm's train.py turns them on (docs/training.md).

Two parts, each on the same weights and inputs with TF32 off, then on (`torch.backends.cuda.matmul.allow_tf32` and
`torch.backends.cudnn.allow_tf32`, the switches timm's train.py sets; `cudnn.benchmark` with them):
  accuracy: float32 logits of ViT-T, CRATE-T and SOFT-T (eval, 224 px) against the same model in float64, and SOFT's
            Newton–Schulz pseudo-inverse of Gaussian-kernel matrices (49 landmarks, SOFT Eq. 10) against the SVD's,
            since that iteration is the one float32 op the dtype policy keeps out of low precision on purpose;
  speed:    float32 training steps (batch 128, 224 px, AdamW) of the same models, images/s.
Run on a lent GPU by tools/gpu_check.sh after the suite and the bench; writes `--output` (JSON). On a CPU it runs
at a tiny size (TF32 is a CUDA switch, so off and on coincide there), which is how the default suite checks it.

    python3 tools/gpu_tf32.py --output $OUT/tf32.json
"""
import math
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import structformer  # noqa: F401  (registers the models)
from structformer.bench.gpu_measure import training_setup
from structformer.bench.harness import median_seconds
from structformer.bench.probes import probe_arguments, probe_device, probe_record, run_parts
from structformer.functional.newton_pinv import newton_pinv, newton_pinv_reference
from structformer.models.factory import build_model

MODELS = [('ViT-T', 'vit_tiny_patch16_224'), ('CRATE-T', 'crate_tiny_patch16_224'), ('SOFT-T', 'soft_tiny_224')]


@contextmanager
def tf32(on: bool):
    """TF32 matmuls and convolutions (and cudnn.benchmark) on or off, restored afterwards."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.double() - reference) / torch.linalg.vector_norm(reference))


def model_accuracy(name: str, side: int, batch: int, device) -> dict:
    torch.manual_seed(0)
    model, _ = build_model(name, dict(img_size=side, num_classes=1000), None, [])
    model.eval().to(device)
    images = torch.randn(batch, 3, side, side, device=device)
    with torch.no_grad():
        reference = model.double()(images.double())
        model.float()
        out = {}
        for on in (False, True):
            with tf32(on):
                out['tf32' if on else 'fp32'] = relative_error(model(images), reference)
    return out


def pinv_accuracy(device, batch: int = 16, landmarks: int = 49, dim: int = 64) -> dict:
    """SOFT's kernel on landmarks: A_ij = exp(−‖q_i − q_j‖² / (2√d)) (Eq. 4 on the landmark set), float64 reference.
    The landmarks' spread sets the conditioning (pooled queries of a trained model sit close together), so three
    spreads: per spread the median condition number, the relative error of X and the worst residual ‖AXA − A‖/‖A‖."""
    out = {}
    for spread in (1.0, 0.3, 0.1):
        torch.manual_seed(0)
        q = spread * torch.randn(batch, landmarks, dim, device=device, dtype=torch.float64)
        a = torch.exp(-torch.cdist(q, q) ** 2 / (2 * math.sqrt(dim)))
        reference = newton_pinv_reference(a)
        row = {'cond_median': float(torch.linalg.cond(a).median())}
        for on in (False, True):
            with tf32(on):
                x = newton_pinv(a.float(), 20)
            key = 'tf32' if on else 'fp32'
            row[key] = relative_error(x, reference)
            row[key + '_residual'] = float((torch.linalg.matrix_norm(a @ x.double() @ a - a)
                                            / torch.linalg.matrix_norm(a)).max())
        out[f'spread {spread}'] = row
    return out


def training_speed(name: str, side: int, batch: int, steps: int, device) -> dict:
    model, optimizer, images, targets = training_setup(name, side, batch, device)

    def step():
        loss = F.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    out = {}
    for on in (False, True):
        with tf32(on):
            seconds = median_seconds(step, steps, 2, device)
        out['tf32' if on else 'fp32'] = batch / seconds
    out['speedup'] = out['tf32'] / out['fp32']
    return out


def main(argv=None) -> int:
    args = probe_arguments(__doc__.splitlines()[0], 80.0, argv)
    device = probe_device()
    cuda = device.type == 'cuda'
    side, batch, steps = (224, 128, 10) if cuda else (32, 2, 1)
    record = probe_record('tools/gpu_tf32.py', argv, device, ['accuracy', 'train_img_per_s'], batch_size=batch,
                          img_size=side)
    parts = [('accuracy', 'Newton-Schulz pinv', lambda: pinv_accuracy(device), None)]
    parts += [('accuracy', label, lambda n=name: model_accuracy(n, side, 8 if cuda else 1, device), None)
              for label, name in MODELS]
    parts += [('train_img_per_s', label, lambda n=name: training_speed(n, side, batch, steps, device), None)
              for label, name in MODELS]
    return run_parts(record, parts, args.budget_s, args.output, device)

if __name__ == '__main__':
    sys.exit(main())
