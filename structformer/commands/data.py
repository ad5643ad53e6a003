"""`structformer data ACTION`: dataset tools; `shard` writes an image folder as webdataset shards (data/wds.py)."""
import argparse

from ..cli_args import positive_int

EXAMPLES = """examples:
  structformer data shard /data/imagenet /data/imagenet-wds --shard-size 1000
  structformer train --model crate_base --data wds:/data/imagenet-wds          # the folder's _info.json names the splits"""


def add_arguments(p) -> None:
    actions = p.add_subparsers(dest='action', metavar='ACTION')
    actions.required = True
    s = actions.add_parser('shard', help='write an ImageFolder as webdataset tar shards (KEY.jpg + KEY.cls, _info.json)',
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    s.add_argument('imagefolder', metavar='IMAGEFOLDER', help='class sub-folders; train/ and val/ (or test/) become two splits')
    s.add_argument('out', metavar='OUT', help='a new (or empty) folder; written all at once, nothing on failure')
    s.add_argument('--shard-size', type=positive_int('--shard-size'), default=1000, help='samples per shard (1000)')
    s.add_argument('--seed', type=int, default=0, help='seed of the order the training samples are written in')
    s.add_argument('--check', choices=['header', 'decode', 'none'], default='header',
                   help='up-front check of the images (header: open each file without decoding)')


def run(args) -> int:
    """`structformer data shard IMAGEFOLDER OUT`: webdataset shards of an image folder (data/wds.py)."""
    from ..data.wds import shard_patterns, write_shards
    info = write_shards(args.imagefolder, args.out, args.shard_size, seed=args.seed, check=args.check)
    for split in info['splits'].values():
        print(f"{split['name']}: {split['num_samples']} samples in {len(split['filenames'])} shard(s)")
    print(f"wrote {args.out} ({len(info['classes'])} classes); train with --data {shard_patterns(args.out, info)}")
    return 0


