"""Token pooling shared by the models' `forward_head` (timm's `global_pool` convention)."""
import torch


def pool_tokens(x: torch.Tensor, global_pool: str, num_prefix_tokens: int) -> torch.Tensor:
    """'token': the cls token; 'avg': mean of the non-prefix tokens; '': unchanged."""
    if global_pool == 'token':
        return x[:, 0]
    if global_pool == 'avg':
        return x[:, num_prefix_tokens:].mean(dim=1)
    return x
