"""The up-front check of a big image folder: cheap by default, parallel, once per run, cached.

'header' opens each file with PIL, which reads and parses the header only (format, size, mode) and
decodes nothing: a file that is not an image, empty or cut inside its header is found; a JPEG cut in its
data is not (training meets it, and bad_images=skip replaces it then). 'decode' decodes every image
(JPEGs at 1/8 scale through PIL's draft mode, which still reads every byte). Opening releases the GIL
for the reads, so threads.

The result (the files that failed, with reasons) is cached under $STRUCTFORMER_CACHE (default
~/.cache/structformer) keyed by the mode and the file list with every file's size and modification
time: a second run on the same folder skips the pass; a changed, added or removed file invalidates it.
Under torchrun the check runs on process 0 and the result is broadcast to the others.
"""
import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

MODES = ('header', 'decode', 'none')
_THREADS = 16        # header reads are I/O: more threads than cores pay off on network and cold disks


def header_problem(path: str) -> Optional[str]:
    """None if PIL recognises `path`'s header as an image, else the reason; nothing is decoded."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            if im.size[0] < 1 or im.size[1] < 1:
                return f'image size {im.size}'
    except Exception as e:           # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        return str(e) or type(e).__name__
    return None


def decode_problem(path: str) -> Optional[str]:
    """None if `path` decodes as an image, else the reason it does not."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            im.draft('RGB', (max(1, im.size[0] // 8), max(1, im.size[1] // 8)))   # JPEG only; others ignore it
            im.load()
    except Exception as e:
        return str(e) or type(e).__name__
    return None


def cache_dir() -> str:
    root = os.environ.get('STRUCTFORMER_CACHE') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'structformer')
    return os.path.join(root, 'image-checks')


def _in_threads(fn, items: Sequence, threads: int) -> list:
    """[fn(x) for x in items] in `threads` threads over contiguous chunks (ThreadPoolExecutor.map makes one future
    per item, whose overhead alone is seconds for 50,000 files; its chunksize applies to processes only)."""
    items = list(items)
    if not items:
        return []
    threads = max(1, min(threads, len(items)))
    step = -(-len(items) // threads)
    with ThreadPoolExecutor(threads) as pool:
        parts = pool.map(lambda i: [fn(x) for x in items[i:i + step]], range(0, len(items), step))
        return [y for part in parts for y in part]


def _stat(path: str) -> str:
    try:
        st = os.stat(path)
        return f'{path}\t{st.st_size}\t{st.st_mtime_ns}'
    except OSError as e:
        return f'{path}\t{e.errno}'


def fingerprint(paths: Sequence[str], mode: str) -> str:
    """sha256 of the mode and every file's path, size and modification time (stat'ed in threads)."""
    lines = _in_threads(_stat, paths, _THREADS)
    digest = hashlib.sha256(f'{mode}\n'.encode())
    for line in lines:
        digest.update(line.encode() + b'\n')
    return digest.hexdigest()


def run_check(paths: Sequence[str], mode: str) -> List[Tuple[str, str]]:
    """(path, reason) for each file of `paths` that fails the check `mode`."""
    if mode == 'none' or not paths:
        return []
    check = header_problem if mode == 'header' else decode_problem
    threads = _THREADS if mode == 'header' else min(8, os.cpu_count() or 1)
    problems = _in_threads(check, paths, threads)
    return [(p, why) for p, why in zip(paths, problems) if why is not None]


def cached_check(paths: Sequence[str], mode: str, label: str = '') -> List[Tuple[str, str]]:
    """run_check through the cache (see the module's doc); prints whether the cache was used."""
    if mode == 'none' or not paths:
        return []
    key = fingerprint(paths, mode)
    path = os.path.join(cache_dir(), key + '.json')
    try:
        with open(path) as f:
            cached = json.load(f)
        if cached.get('files') == len(paths):
            print(f'{label}: {mode} check of {len(paths)} files reused from {path}', flush=True)
            return [tuple(item) for item in cached['bad']]
    except (OSError, ValueError, KeyError):
        pass
    bad = run_check(paths, mode)
    try:
        from ..atomic import write_text_atomically
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomically(path, json.dumps({'mode': mode, 'files': len(paths), 'bad': bad}))
    except OSError as e:                      # a read-only home: check again next time
        print(f'{label}: could not cache the image check in {path} ({e})', file=sys.stderr, flush=True)
    return bad


def shared_check(paths: Sequence[str], mode: str, label: str = '') -> List[Tuple[str, str]]:
    """cached_check on process 0 of a torchrun group, its result broadcast to the others (which may see another
    file system cache, or none); a plain call without torch.distributed."""
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:
        distributed = False
    if not distributed:
        return cached_check(paths, mode, label)
    box = [cached_check(paths, mode, label) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return [tuple(item) for item in box[0]]
