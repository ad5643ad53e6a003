"""`structformer bench data`: can the loader feed the model? Images/s of decode + training transform.

One run builds N generated JPEGs at ImageNet's typical size (about 500x375, photo-like noise so they
compress as photos do), writes them as a folder and as shards, and times, at each worker count, full
passes of three loaders with equal transforms: our ImageFolder (data/imagefolder.py), our shards
(data/shards.py) and timm's create_dataset + create_loader; each with random-resized-crop + flip, and again
with RandAugment (rand-m9-mstd0.5-inc1) + random erasing (0.25). It also times one training step of
crate_tiny_patch16_224 (float32 and bfloat16 autocast) and reports the images/s that step needs, against
what each loader gives. The load average before and after goes into the JSON: numbers from a busy machine
are not measurements.
"""
import os
import tempfile
import time

from .kinds import add_record_arguments, print_header, write_record
from ..cli_args import thread_count
from .load import run_record

EXAMPLES = """examples:
  structformer bench data --images 2000 --workers 1 2 --output outputs/bench/data.json
  structformer bench data --images 64 --batch-size 16            # a quick check that it runs"""
# Both through timm's create_transform on our side too (an Augmentation request), so the pipelines are equal.
RECIPES = {'rrc_flip': {'hflip': 0.5}, 'rrc_flip_ra_re': {'hflip': 0.5, 'aa': 'rand-m9-mstd0.5-inc1', 'reprob': 0.25}}
LOADERS = ('imagefolder', 'shards', 'timm')


def add_arguments(p):
    p.add_argument('--images', type=int, default=2000, help='generated JPEGs (2000)')
    p.add_argument('--workers', type=int, nargs='+', default=[1, 2], help='loader worker counts (1 2)')
    p.add_argument('--batch-size', type=int, default=64, help='images per loader batch (64)')
    p.add_argument('--img-size', type=int, default=224,
                   help="side of the training crops, and of the timed training step's input (224)")
    p.add_argument('--model', default='crate_tiny_patch16_224', help='the model whose training step is timed')
    p.add_argument('--step-batch', type=int, default=8, help='batch of the timed training step (8)')
    p.add_argument('--threads', type=thread_count, default=0,
                   help="torch threads of this process: the timed training step and the main process's part of "
                        "loading (0: torch's default); each loader worker is a process of one thread")
    p.add_argument('--folder', default=None, help='keep the generated images here (default: a temporary folder)')
    p.add_argument('--output', default=None, help='write the results as JSON here')
    add_record_arguments(p)
    p.add_argument('--up-front', type=int, default=0, metavar='N',
                   help='instead: time the up-front check of an image folder of N small JPEGs (160x120): '
                        'check=decode (the old default), header (first run, then cached) and none')


def generate_jpegs(root: str, n: int, classes: int = 10, size=(500, 375), seed: int = 0) -> None:
    """n JPEGs in `classes` class folders: smooth colour fields plus noise (quality 90, about 60-100 kB each)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    classes = max(1, min(classes, n))           # an empty class folder is not an image folder
    for c in range(classes):
        os.makedirs(os.path.join(root, f'class_{c:02d}'), exist_ok=True)
    for i in range(n):
        field = Image.fromarray(np.roll(base, i, axis=0)).resize((w, h), Image.BILINEAR)
        pixels = np.asarray(field, dtype=np.int16) + rng.integers(-24, 24, (h, w, 3), dtype=np.int16)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
            os.path.join(root, f'class_{i % classes:02d}', f'{i:06d}.jpg'), quality=90)


def _augmentation(recipe):
    from ..data.augment import Augmentation
    return Augmentation(**RECIPES[recipe])


def loader_rate(kind: str, folder: str, shards: str, recipe: str, workers: int, batch: int, img_size: int) -> dict:
    """Images/s over one full pass (workers started before the clock: their start-up is not decode speed)."""
    import torch
    from torch.utils.data import DataLoader
    aug = _augmentation(recipe)
    if kind == 'timm':
        from timm.data import create_dataset, create_loader
        ds = create_dataset('', root=os.path.join(folder, 'train'), split='', is_training=True)
        opts = RECIPES[recipe]
        loader = create_loader(ds, input_size=(3, img_size, img_size), batch_size=batch, is_training=True,
                               no_aug=False, scale=(0.08, 1.0), hflip=0.5, color_jitter=None,
                               auto_augment=opts.get('aa'), re_prob=opts.get('reprob', 0.0), re_mode='pixel',
                               num_workers=workers, use_prefetcher=False, persistent_workers=True,
                               interpolation='bilinear')
        # the same fix our pipeline carries: timm's 0-bit posterize raises on Pillow >= 13 (data/augment.py)
        from ..data.augment import allow_zero_bit_posterize
        allow_zero_bit_posterize(ds.transform)
    else:
        from ..data import build_datasets
        spec = f'imagefolder:{folder}' if kind == 'imagefolder' else f'wds:{shards}'
        options = dict(img_size=img_size, check='none') if kind == 'imagefolder' else dict(img_size=img_size)
        if kind == 'shards':
            options['shuffle_buffer'] = 256
        train, _, _ = build_datasets(spec, augmentation=aug, **options)
        if kind == 'shards':
            from ..data.shards import stream_loader
            loader, order, _ = stream_loader(train, batch_size=batch, workers=workers, rank=0, world_size=1,
                                             drop_last=False)
            order.set_epoch(1)
        else:                       # as the engine loads it: per-sample seeded augmentation (data/seeding.py)
            from ..data.seeding import EpochOrder, SeededSamples, ShuffledOrder
            order = EpochOrder(ShuffledOrder(len(train), 0))
            order.set_epoch(1)
            loader = DataLoader(SeededSamples(train, 0), batch_size=batch, sampler=order, num_workers=workers,
                                persistent_workers=True)
    it = iter(loader)
    next(it)                                    # workers up, first batch out: not counted
    n, seconds = 0, 0.0
    start = time.perf_counter()
    for x, _ in it:
        n += x.shape[0]
    seconds = time.perf_counter() - start
    del it, loader
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {'loader': kind, 'recipe': recipe, 'workers': workers, 'images': n, 'seconds': seconds,
            'images_per_s': n / seconds if seconds else None}


def step_rate(model_name: str, batch: int, img_size: int, dtype: str, steps: int = 3) -> float:
    """Images/s of full training steps (forward, backward, AdamW) of `model_name` on this machine's CPU."""
    import timm
    import torch
    import structformer.models  # noqa: F401  (registers the models)
    model = timm.create_model(model_name, num_classes=1000, img_size=img_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 3, img_size, img_size), torch.randint(0, 1000, (batch,))
    autocast = torch.autocast('cpu', dtype=torch.bfloat16) if dtype == 'bfloat16' else None

    def step():
        with autocast if autocast is not None else torch.autocast('cpu', enabled=False):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def up_front(n: int, folder: str) -> dict:
    """Seconds to build an imagefolder of n generated 160x120 JPEGs with each check (a fresh cache)."""
    import numpy as np
    from PIL import Image

    from ..data import build_datasets
    if not os.path.isdir(folder) or not os.listdir(folder):
        rng = np.random.default_rng(0)
        base = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).resize((160, 120), Image.BILINEAR)
                for _ in range(64)]
        # up to 100 classes, at least 5 images each: the 1/5 held out for validation has one of every class
        classes = max(1, min(100, n // 5))
        for i in range(n):
            os.makedirs(os.path.join(folder, f'c{i % classes:03d}'), exist_ok=True)
            base[i % 64].save(os.path.join(folder, f'c{i % classes:03d}', f'{i:06d}.jpg'), quality=85 + i % 10)
    # a fresh cache of its own, removed afterwards: it was `check-cache` beside --folder, which the run deleted
    # first (a user's folder of that name too) and left behind after
    cache_root = tempfile.TemporaryDirectory(prefix='structformer-check-cache-')
    saved = os.environ.get('STRUCTFORMER_CACHE')
    os.environ['STRUCTFORMER_CACHE'] = cache_root.name
    out = {}
    try:
        build_datasets(f'imagefolder:{folder}', img_size=8, check='none')     # imports and listing warm, not timed
        for label, check in (('decode (before)', 'decode'), ('header, first run', 'header'),
                             ('header, cached', 'header'), ('none', 'none')):
            start = time.perf_counter()
            build_datasets(f'imagefolder:{folder}', img_size=8, check=check)
            out[label] = time.perf_counter() - start
            print(f'{label:18} {out[label]:7.2f} s', flush=True)
    finally:
        if saved is None:
            os.environ.pop('STRUCTFORMER_CACHE', None)
        else:
            os.environ['STRUCTFORMER_CACHE'] = saved
        cache_root.cleanup()
    return out


def _check_room(args) -> None:
    """Refuse, before writing a file, what cannot fit: the generated JPEGs on the disk that holds them (~100 kB each at
    500x375, ~10 kB at the up-front check's 160x120) and a batch of crops in memory (float32, with a generous 16x for
    the loader's copies and the timed step's activations)."""
    import shutil
    from ..errors import UsageError
    images, each = (args.up_front, 10_000) if args.up_front else (args.images, 100_000)
    where = args.folder or tempfile.gettempdir()
    existing = where
    while not os.path.exists(existing):                  # the folder is made later: the disk of its nearest parent
        existing = os.path.dirname(os.path.abspath(existing))
    free = shutil.disk_usage(existing).free
    if images * each > free:
        flag = '--up-front' if args.up_front else '--images'
        raise UsageError(f"{flag} {images}: the generated JPEGs need about {images * each / 2 ** 30:,.1f} GiB, more "
                         f"than the {free / 2 ** 30:.1f} GiB free in {where}; give fewer images")
    if not args.up_front:
        from ..machine import check_fits_memory
        batch = max(args.batch_size, args.step_batch)
        check_fits_memory(batch * 3 * args.img_size ** 2 * 4 * 16,
                          f"--img-size {args.img_size} with batches of {batch}: the loader and the step",
                          'give a smaller size or batch', UsageError)


def run(args) -> int:
    from ..errors import UsageError
    from ..records import check_output_file
    if args.output:
        check_output_file(args.output, '--output')
    for flag in ('batch_size', 'img_size', 'step_batch'):       # before generating images: no torch traceback later
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")
    if not args.up_front:            # the training step is timed last: an unknown model must not cost the loader rows
        import timm
        import structformer.models  # noqa: F401  (registers the models)
        if not timm.is_model(args.model):
            raise UsageError(f"--model {args.model!r} is not a registered model; `structformer models` lists them")
    if args.up_front < 0 or 0 < args.up_front < 10:
        raise UsageError(f'--up-front {args.up_front}: expected a number of images >= 10 (0: the loader benchmark)')
    _check_room(args)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.up_front:
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix='structformer-bench-data-') as tmp:
            seconds = up_front(args.up_front, args.folder or os.path.join(tmp, 'images'))
        result = {'up_front_seconds': seconds, 'images': args.up_front, 'size': '160x120 JPEG',
                  'load_average_before': load_before, 'load_average_after': os.getloadavg(),
                  'cpu_count': os.cpu_count()}
        from ..records import environment         # as every other record: the CPU kind and whether others were busy
        result.update(environment=environment('cpu'), machine_load=run_record(),
                      args={k: v for k, v in vars(args).items() if k not in ('func', 'command', 'target')})
        if args.output:
            print(f'wrote {write_record(args.output, result, args.allow_busy)}')
        return 0
    if args.images < args.batch_size * 2:
        raise UsageError(f'--images {args.images}: give at least two batches (2 x --batch-size {args.batch_size})')
    if any(w < 1 for w in args.workers):
        raise UsageError(f'--workers {args.workers}: each worker count must be >= 1')
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix='structformer-bench-data-') as tmp:
        folder = args.folder or os.path.join(tmp, 'images')
        if not os.path.isdir(folder) or not os.listdir(folder):
            start = time.perf_counter()
            classes = min(10, args.images)                                # no class folder left empty
            generate_jpegs(os.path.join(folder, 'train'), args.images, classes)
            generate_jpegs(os.path.join(folder, 'val'), classes, classes, seed=1)   # a val/ split: all N images train
            print(f'generated {args.images} JPEGs in {time.perf_counter() - start:.1f} s', flush=True)
        from ..data.shard_writer import write_shards
        shard_dir = os.path.join(tmp, 'shards')
        shard_size = max(1, -(-args.images // (2 * max(args.workers))))     # at least one shard per worker
        info = write_shards(folder, shard_dir, shard_size, check='none')
        names = info['splits']['train']['filenames']
        shards = '::'.join(os.path.join(shard_dir, f) for f in names) + ',' + os.path.join(
            shard_dir, info['splits']['validation']['filenames'][0])
        rows = []
        for recipe in RECIPES:
            for workers in args.workers:
                for kind in LOADERS:
                    row = loader_rate(kind, folder, shards, recipe, workers, args.batch_size, args.img_size)
                    rows.append(row)
                    print(f"{recipe:14} workers {workers}  {kind:12} {row['images_per_s']:8.1f} img/s", flush=True)
    needs = {}
    for dtype in ('float32', 'bfloat16'):
        needs[dtype] = step_rate(args.model, args.step_batch, args.img_size, dtype)
        print(f'one training step of {args.model} ({dtype}, batch {args.step_batch}) consumes '
              f'{needs[dtype]:.1f} img/s on this machine', flush=True)
    ratios = {}
    for recipe in RECIPES:
        for workers in args.workers:
            by = {r['loader']: r['images_per_s'] for r in rows if r['recipe'] == recipe and r['workers'] == workers}
            for kind in ('imagefolder', 'shards'):
                ratios[f'{recipe}/workers{workers}/{kind}_vs_timm'] = by[kind] / by['timm']
                print(f'{recipe:14} workers {workers}  {kind} / timm = {by[kind] / by["timm"]:.2f}x', flush=True)
    # can the loader feed the model: its images/s over what one training step consumes (>= 1: it keeps up)
    feeds = {f"{r['recipe']}/workers{r['workers']}/{r['loader']}/{dtype}": r['images_per_s'] / needs[dtype]
             for r in rows for dtype in needs}
    best = max(rows, key=lambda r: r['images_per_s'])
    for dtype, rate in needs.items():
        print(f"{dtype}: the fastest loader row ({best['loader']}, {best['recipe']}, {best['workers']} workers) gives "
              f"{best['images_per_s'] / rate:.1f}x the images/s a training step consumes", flush=True)
    from ..records import environment
    env = environment('cpu')
    print_header(env)
    result = {'environment': env, 'feeds_training_step': feeds, 'images': args.images, 'batch_size': args.batch_size, 'img_size': args.img_size, 'rows': rows,
              'ratios_vs_timm': ratios, 'training_step_images_per_s': needs, 'model': args.model,
              'load_average_before': load_before, 'load_average_after': os.getloadavg(),
              'cpu_count': os.cpu_count(), 'threads': args.threads or None, 'goal': 'our loaders >= 1.0x timm images/s with equal transforms',
              'machine_load': run_record(), 'args': {k: v for k, v in vars(args).items() if k not in ('func', 'command', 'target')}}
    if args.output:
        print(f'wrote {write_record(args.output, result, args.allow_busy)}')
    return 0
