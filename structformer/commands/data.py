"""`structformer data ACTION`: dataset tools; `shard` writes a data set as webdataset shards (data/shard_writer.py)."""
import argparse

from ..cli_args import positive_int

EXAMPLES = """examples:
  structformer data shard /data/images /data/images-wds --shard-size 1000 --workers 8   # train/ and val/ -> two splits
  structformer data shard imagenet:/data/ILSVRC2012 /data/imagenet-wds --workers 16      # the download as it is
  structformer data shard hfds:/data/my-hf-dataset /data/hf-wds
  structformer data shard timm::/data/images /data/timm-order-wds      # timm's folder reader (its class order)
  structformer train --model crate_tiny_patch16_224 --data wds:/data/imagenet-wds    # _info.json names the splits

Interrupted (Ctrl-C, kill -9, a full disk), the finished shards stay in .OUT.shard-work/ beside OUT (in
OUT/.shard-work/ where OUT is a mounted disk): the same command resumes from them; other input or settings
remove them; --clean removes them in any case."""


def add_arguments(p) -> None:
    actions = p.add_subparsers(dest='action', metavar='ACTION')
    actions.required = True
    s = actions.add_parser('shard', help='write a data set as webdataset tar shards (KEY.jpg + KEY.cls, _info.json)',
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                           allow_abbrev=False)
    s.add_argument('source', metavar='SOURCE',
                   help='an image folder (class sub-folders; train/ and val/, valid/, validation/ or test/ become '
                        'two splits), '
                        'hfds:PATH, imagenet:PATH (ILSVRC-2012 as downloaded), or timm:NAME:ROOT (timm\'s '
                        'create_dataset; timm::ROOT for its folder or tar reader)')
    s.add_argument('out', metavar='OUT', help='a new (or empty) folder; renamed into place when complete')
    s.add_argument('--shard-size', type=positive_int('--shard-size'), default=1000, help='samples per shard (1000)')
    s.add_argument('--workers', type=positive_int('--workers'), default=1,
                   help='writer processes, a shard each at a time (1); the bytes are the same for any count')
    s.add_argument('--bad-images', choices=['error', 'skip'], default='error',
                   help='an image that does not decode: stop naming it (error), or leave it out, listed in '
                        "_info.json's left_out (skip)")
    s.add_argument('--seed', type=int, default=0, help='seed of the order the training samples are written in')
    s.add_argument('--check', choices=['header', 'decode', 'none'], default='header',
                   help="an image folder's cached up-front check, naming every bad file before anything is written "
                        '(header: open each file without decoding); every image is decoded as it is written anyway')
    s.add_argument('--clean', action='store_true',
                   help="remove OUT's work folder left by an earlier run (kept to resume from) and start afresh")


def run(args) -> int:
    """`structformer data shard SOURCE OUT`: webdataset shards of a data set (data/shard_writer.py)."""
    from ..data.shard_writer import shard_patterns, write_shards
    info = write_shards(args.source, args.out, args.shard_size, seed=args.seed, workers=args.workers,
                        bad_images=args.bad_images, clean=args.clean, check=args.check)
    for split in info['splits'].values():
        left_out = f", {len(split['left_out'])} left out (see _info.json)" if split.get('left_out') else ''
        print(f"{split['name']}: {split['num_samples']} samples in {len(split['filenames'])} shard(s){left_out}")
    classes = f"{len(info['classes'])} classes" if info.get('classes') else 'no class names'
    print(f"wrote {args.out} ({classes}); train with --data {shard_patterns(args.out, info)}")
    return 0
