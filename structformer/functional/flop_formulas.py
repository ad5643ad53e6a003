"""FLOP formulas for the package's own opaque ops (custom ops, the tile kernel's library, oneDNN's linear), which
torch's FlopCounterMode cannot look inside: registered once in torch's registry where each op is defined, so any
count (`structformer models --flops`, the benchmarks, a user's own FlopCounterMode) sees their products."""
from torch.utils import flop_counter


def register_flop_formulas(formulas) -> None:
    """Register each (op, formula) pair: formula(*shapes of the op's arguments, out_shape=..., **kwargs) -> FLOPs
    (a multiply-add is 2). An op already registered is left as it is: a second import or a reloaded library is no
    error."""
    for op, formula in formulas:
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)
