"""--aug-repeats: timm's RepeatAugSampler seeds its order by the epoch alone, so --seed changed nothing about the
data order; ours keys it by (seed, epoch), and at seed 0 it is timm's order exactly."""
from timm.data.distributed_sampler import RepeatAugSampler

from structformer.data.seeding import repeat_aug_order
from structformer.train import TrainConfig, Trainer


def _orders(seed, epoch, world=2, size=300, repeats=3):
    data = range(size)
    orders = []
    for rank in range(world):
        order = repeat_aug_order(data, world, rank, repeats, seed)
        order.set_epoch(epoch)
        orders.append(list(order))
    return orders


def test_the_order_follows_the_seed_and_is_timms_at_seed_0():
    timm_orders = []
    for rank in range(2):
        reference = RepeatAugSampler(range(300), num_replicas=2, rank=rank, shuffle=True, num_repeats=3)
        reference.set_epoch(4)
        timm_orders.append(list(reference))
    assert _orders(0, 4) == timm_orders
    assert _orders(1, 4) != _orders(0, 4) and _orders(1, 4) == _orders(1, 4) and _orders(1, 5) != _orders(1, 4)
    assert [len(o) for o in _orders(7, 1)] == [len(o) for o in timm_orders]        # timm's epoch length


def test_the_engine_passes_its_seed(tmp_path):
    def first_epoch(seed):
        trainer = Trainer(TrainConfig(model='crate_digits', data='digits', epochs=1, aug_repeats=3, seed=seed,
                                      output=str(tmp_path / f'run{seed}')), progress=False)
        trainer._build()
        trainer._make_loaders()
        trainer.train_order.set_epoch(1)
        return [index for _, _, index in trainer.train_order]
    assert first_epoch(1) != first_epoch(2)
