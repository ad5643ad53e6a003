"""Pure tensor functions, each with a slow reference beside it for tests."""
from .coding_rate import (coding_rate, coding_rate_per_head, compression_rate, compression_rate_grad,
                          sparsity, split_heads)
from .crate_ops import ista_reference, mm_sparsify_reference, mssa_reference, ssa_per_head_reference
from .gaussian_kernel import gaussian_kernel, gaussian_kernel_reference
from .newton_pinv import newton_pinv, newton_pinv_reference, pinv_residual
