"""`structformer data shard SOURCE OUT`: webdataset tar shards of an image data set (docs/data.md).

SOURCE is an image folder, `hfds:PATH`, `imagenet:PATH` or `timm:NAME:ROOT` (shard_sources.py). What goes
in: the training samples in a seeded random order (so a shard mixes classes, which the stream's shard-level
shuffle needs), the validation ones in their order; every image is decoded before it is written (a JPEG cut
after its header is refused, or left out under `--bad-images skip`, named), but stored as its own bytes;
every member has fixed metadata, so the same input gives the same bytes; `_info.json` in timm's format
plus the class names and what was left out.

How: the shards are written by `--workers` processes into a work folder beside OUT, `.OUT.shard-work/`,
which holds an owner file (host, process id and start time, and a digest of the plan) and the finished
shards; the folder is renamed to OUT when all are there, with the permissions the umask gives (a
temporary folder's 0700 is not kept). Progress and an ETA are printed as shards finish. Interrupted
(Ctrl-C, kill -9, a crash), the work folder stays: the next run with the same plan takes up the finished
shards and writes the rest; a run with another plan removes it; if its owner is still running, the run
is refused; `--clean` removes it in any case.
"""
import errno
import hashlib
import io
import json
import os
import shutil
import socket
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import UsageError
from .shard_sources import Source, folder_source, hfds_source, timm_source

FORMAT = 2      # bump when what a shard holds changes: a work folder of another format is not resumed (2: members
                # named by the image's format, .jpg where a .JPEG file gave .jpeg)
_OWNER = '_owner.json'
WORK_SUFFIX = '.shard-work'


def work_folder(out: str) -> str:
    """The work folder of OUT: a hidden sibling, so nothing reading OUT's parent takes it for a data set; inside
    OUT where OUT is a mounted disk (`_mounted`), whose sibling would be on another disk."""
    out = os.path.abspath(out)
    if _mounted(out):
        return os.path.join(out, WORK_SUFFIX)
    return os.path.join(os.path.dirname(out), '.' + os.path.basename(out) + WORK_SUFFIX)


def _mounted(out: str) -> bool:
    """OUT an existing folder on another file system than its parent (an empty disk mounted there): a sibling
    work folder filled the parent's disk, and the final rename over OUT failed ('Device or resource busy')."""
    try:
        return os.path.isdir(out) and (os.path.ismount(out) or
                                       os.stat(out).st_dev != os.stat(os.path.dirname(out)).st_dev)
    except OSError:
        return False


def _move_into(work: str, target: str) -> None:
    """The finished work folder's files moved into the existing folder `target` (same file system), _info.json
    last, so that a reader of `wds:OUT` sees a whole data set or none; then the work folder removed."""
    for name in sorted(os.listdir(work), key=lambda n: n == '_info.json'):
        os.replace(os.path.join(work, name), os.path.join(target, name))
    os.rmdir(work)


def open_source(text: str) -> Source:
    """SOURCE of `data shard`: PATH or imagefolder:PATH (an image folder), hfds:PATH, imagenet:PATH,
    timm:NAME:ROOT (timm's create_dataset; NAME may be empty: timm:ROOT)."""
    form, name, path = _split_source(text)
    if form == 'hfds':
        return hfds_source(path)
    if form == 'imagenet':
        from .imagenet import imagenet_source
        return imagenet_source(path, 'SOURCE imagenet:')
    if form == 'timm':
        _check_timm_source(text, name, path)
        return timm_source(name, path)
    prefix, sep, _ = text.partition(':')
    if sep and prefix.isidentifier() and not os.path.isdir(os.path.expanduser(text)):
        # a form of --data that is not a SOURCE (wds:DIR, digits:): say so, not that DIR is "not a folder"
        what = ('shards already: training reads them as they are (--data wds:DIR)' if prefix.lower() == 'wds'
                else f"'{prefix}:' is not a form of SOURCE")
        raise UsageError(f'SOURCE {text}: {what} (accepted: an image folder, imagefolder:PATH, hfds:PATH, '
                         'imagenet:PATH, timm:NAME:ROOT)')
    return folder_source(path)


TIMM_FORMS = ('timm:ROOT (an image folder or a .tar), timm:torch/NAME:ROOT or timm:hfds/NAME:ROOT (timm\'s '
              'create_dataset NAME)')


def _check_timm_source(text: str, name: str, root: str) -> None:
    """timm's create_dataset reads NAME's TYPE/ prefix alone: a NAME without one ('nosuch') was ignored, ROOT read as
    an image folder and the shards written as if NAME had been honoured; an empty ROOT was 'SOURCE timm::: does not
    exist'. Both are one line naming SOURCE and the accepted forms."""
    if not root:
        raise UsageError(f'SOURCE {text!r}: no ROOT; accepted: {TIMM_FORMS}')
    prefix, sep, rest = name.partition('/')
    if name and (not sep or not rest or prefix.lower() not in ('torch', 'hfds', 'hfids', 'tfds', 'wds')):
        raise UsageError(f'SOURCE {text!r}: NAME {name!r} is not a timm TYPE/NAME data set name (timm ignores a '
                         f'NAME without TYPE/ and reads ROOT as an image folder); accepted: {TIMM_FORMS}')


def _split_source(text: str):
    """(form, timm's NAME or '', path) of SOURCE: hfds / imagenet / imagefolder:PATH, timm:NAME:ROOT or timm:ROOT,
    and anything else an image folder's path as written."""
    form, sep, rest = text.partition(':')
    form = form.lower() if sep else ''
    if form == 'timm':
        name, sep, root = rest.partition(':')
        return form, (name if sep else ''), (root if sep else name)
    if form in ('hfds', 'imagenet', 'imagefolder'):
        return form, '', rest
    return 'imagefolder', '', text



def _check_out_outside_source(text: str, out: str) -> None:
    """Refuse an OUT inside a folder SOURCE (an image folder, imagenet:, timm:NAME:ROOT): OUT and its work folder
    beside it would become class folders of that source, without images, which breaks its next read (torchvision's
    ImageFolder: 'Found no valid file for the classes ...')."""
    form, _, root = _split_source(text)
    if form == 'hfds' or not root or not os.path.isdir(root):
        return                                   # open_source names a missing SOURCE
    if Path(os.path.realpath(os.path.abspath(out))).is_relative_to(os.path.realpath(root)):
        raise UsageError(f'OUT {out}: inside SOURCE {text}; the shards and their work folder would be read as '
                         'part of it (a class folder without images); give a folder outside it')


# ----------------------------------------------------------------------------- owning the work folder

def _start_ticks(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux /proc), which tells a reused process id apart."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> Dict:
    return {'host': socket.gethostname(), 'pid': os.getpid(), 'start': _start_ticks(os.getpid())}


def owner_alive(owner: Dict) -> Optional[bool]:
    """True / False for a process of this host; None when it ran on another host (it cannot be checked)."""
    if owner.get('host') != socket.gethostname():
        return None
    pid = owner.get('pid')
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                         # alive, another user's
    return owner.get('start') is None or _start_ticks(pid) in (None, owner['start'])


def _read_owner(work: str) -> Dict:
    try:
        with open(os.path.join(work, _OWNER)) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def claim(work: str, out: str, plan: str, clean: bool) -> List[str]:
    """Make `work` ours; return the finished shards it already holds for this plan (resumed), else []."""
    if os.path.lexists(work):
        owner = _read_owner(work)
        alive = owner_alive(owner) if owner and not owner.get('released') else False
        who = f"process {owner.get('pid')} on {owner.get('host')}" if owner else 'an unknown process'
        if clean:
            shutil.rmtree(work)
            print(f'data shard: removed {work} (left by {who}; --clean)', flush=True)
        elif alive or alive is None:
            state = 'is still running' if alive else 'ran on another host, so this one cannot tell if it still runs'
            raise UsageError(f'OUT {out}: {work} is being written by {who}, which {state}; wait for it, or if '
                             f'nothing writes it any more pass --clean to remove it')
        elif owner.get('plan') == plan and owner.get('format') == FORMAT:
            for name in os.listdir(work):
                if name.endswith('.part'):           # a shard being written when the run was killed
                    os.unlink(os.path.join(work, name))
            done = sorted(n for n in os.listdir(work) if n.endswith('.tar'))
            _write_owner(work, plan)
            print(f'data shard: resuming the interrupted run of {who}: {len(done)} finished shard(s) in {work} are '
                  'kept', flush=True)
            return done
        else:
            shutil.rmtree(work)
            print(f'data shard: removed {work}, left by an interrupted run ({who}) of other input or settings',
                  flush=True)
    os.makedirs(work)                 # the umask's permissions (mkdtemp would make it 0700)
    _write_owner(work, plan)
    return []


def _write_owner(work: str, plan: str, released: bool = False) -> None:
    from ..atomic import write_text_atomically
    write_text_atomically(os.path.join(work, _OWNER), json.dumps({**_me(), 'plan': plan, 'format': FORMAT,
                                                                   'started': time.time(), 'released': released}))


def _release(work: str, plan: str) -> None:
    """Mark the kept work folder as no longer being written (this process may go on, e.g. a library caller)."""
    try:
        _write_owner(work, plan, released=True)
    except OSError:
        pass                          # a full disk: the owner's process id tells it once this process ends


# ----------------------------------------------------------------------------- one shard (in a writer process)

def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A regular file with fixed metadata, so the same input gives the same bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o444, 0, 0, '', ''
    tar.addfile(info, io.BytesIO(data))


# a ustar member name holds 100 bytes (tarfile's 'name is too long' beyond, as a traceback: a 130-character file
# name, or a 60-character Japanese one at 3 bytes a character, stopped the writer); the longest extension written
# is '.webp', so a key keeps 95 bytes of UTF-8, the position that makes it unique first
_KEY_BYTES = 100 - len('.webp')


def _key(position: int, name: str) -> str:
    stem = os.path.splitext(os.path.basename(name))[0]
    key = f'{position:08d}_' + ''.join(c if c.isalnum() or c in '-_' else '_' for c in stem)
    return key.encode('utf-8')[:_KEY_BYTES].decode('utf-8', 'ignore')      # 'ignore': a character cut in two


def decode_problem(data: bytes) -> Optional[str]:
    """None if the bytes decode to an image (every pixel: a JPEG cut after its header fails), else why not."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.size[0] < 1 or im.size[1] < 1:
                return f'image size {im.size}'
    except Exception as e:           # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        return str(e) or type(e).__name__
    return None


_SOURCE: Optional[Source] = None      # the source, inherited by forked writer processes


def write_one(job: Tuple[str, str, str, List[int], str]) -> Tuple[str, int, List[Tuple[str, str]]]:
    """Write shard `name` of `split` from the source's items `positions` into `work` (NAME.part, renamed when
    whole); returns (name, samples written, [(item, why)] left out). An unreadable item raises unless `skip`."""
    work, split_name, name, positions, bad_images = job
    split = _SOURCE.splits[split_name]
    part, left_out, written = os.path.join(work, name + '.part'), [], 0
    try:
        with tarfile.open(part, 'w', format=tarfile.USTAR_FORMAT) as tar:
            for position in positions:
                try:
                    ext, data = split.read(position)
                    why = decode_problem(data)
                except OSError as e:
                    why = f'{type(e).__name__}: {e}'
                if why is not None:
                    if bad_images != 'skip':
                        # removing the file changes every shard's content (the order is a permutation of the
                        # items), so the finished shards would be written again: hours into ImageNet, say so
                        raise UsageError(f'SOURCE: {split.names[position]} cannot be read ({why}); pass --bad-images '
                                         'skip to leave such images out (named in _info.json; the finished shards are '
                                         'kept), or replace it with a readable copy; removing it changes what every '
                                         'shard holds, so all are written again')
                    left_out.append((split.names[position], why))
                    continue
                key = _key(position, split.names[position])
                _member(tar, f'{key}.{ext}', data)
                _member(tar, f'{key}.cls', str(split.labels[position]).encode())
                written += 1
        with open(os.path.join(work, name + '.json'), 'w') as f:
            json.dump({'samples': written, 'left_out': left_out}, f)
        os.replace(part, os.path.join(work, name))
    except BaseException:
        if os.path.exists(part):
            os.unlink(part)
        raise
    return name, written, left_out


# ----------------------------------------------------------------------------- the whole

def plan_shards(source: Source, shard_size: int, seed: int) -> List[Tuple[str, str, List[int]]]:
    """(split, shard file name, item positions) for every shard: training items in a seeded random order."""
    jobs = []
    for split_name, split in source.splits.items():
        order = (np.random.default_rng(seed).permutation(len(split)) if split_name == 'train'
                 else np.arange(len(split))).tolist()
        for k, start in enumerate(range(0, len(order), shard_size)):
            jobs.append((split_name, f'{split_name}-{k:06d}.tar', order[start:start + shard_size]))
    return jobs


def plan_digest(source: Source, shard_size: int, seed: int) -> str:
    digest = hashlib.sha256(json.dumps([FORMAT, shard_size, seed, source.description, source.classes]).encode())
    for name, split in source.splits.items():
        digest.update(name.encode())
        for item, label in zip(split.names, split.labels):
            digest.update(f'{item}\t{label}\n'.encode())
    return digest.hexdigest()


class Progress:
    """A line per finished shard at most every `interval` seconds (and the last): done / total, rate, ETA."""

    def __init__(self, total: int, done: int, interval: float = 10.0):
        self.total, self.done, self.interval = total, done, interval
        self.start, self.last, self.new, self.shown = time.monotonic(), 0.0, 0, -1

    def add(self, samples: int, final: bool = False) -> None:
        self.done += samples
        self.new += samples
        now = time.monotonic()
        if (not final and now - self.last < self.interval and self.last) or self.shown == self.done:
            return
        self.last, self.shown = now, self.done
        rate = self.new / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float('inf')
        eta_text = time.strftime('%H:%M:%S', time.gmtime(eta)) if eta < 86400 * 30 else '?'
        print(f'data shard: {self.done}/{self.total} images ({100 * self.done / max(self.total, 1):.1f} %), '
              f'{rate:.0f} img/s, ETA {eta_text}', flush=True)


def write_shards(source_text: str, out: str, shard_size: int, seed: int = 0, workers: int = 1,
                 bad_images: str = 'error', clean: bool = False, check: str = 'header',
                 progress_interval: float = 10.0) -> Dict:
    """Write SOURCE's splits as shards in OUT (which must not exist, or be an empty folder); returns _info.json."""
    if not isinstance(shard_size, int) or shard_size < 1:
        raise UsageError(f'--shard-size {shard_size!r}: expected an integer >= 1')
    if not isinstance(workers, int) or workers < 1:
        raise UsageError(f'--workers {workers!r}: expected an integer >= 1')
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 32:   # numpy's generator: >= 0
        raise UsageError(f'--seed {seed!r}: expected an integer in [0, 2**32)')
    if bad_images not in ('error', 'skip'):
        raise UsageError(f"--bad-images {bad_images!r}: expected 'error' or 'skip'")
    if not str(out).strip():
        raise UsageError("OUT '': empty; give a new folder")
    if os.path.exists(out) and (not os.path.isdir(out) or set(os.listdir(out)) - {WORK_SUFFIX}):
        raise UsageError(f'OUT {out}: exists and is not an empty folder; give a new folder')
    _check_out_outside_source(source_text, out)
    from ..records import check_writable
    check_writable(out, 'OUT')
    source = open_source(source_text)
    if not source.splits.get('train') or not len(source.splits['train']):
        raise UsageError(f'SOURCE {source_text}: holds no training image')
    if bad_images == 'error':
        _check_files_first(source, check)
    jobs = plan_shards(source, shard_size, seed)
    # OUT a link to an empty folder (the usual way to put a data set on a bigger disk): the work folder went beside
    # the link, on the link's disk, and the final rename failed ('not a directory') after every shard was written
    target = os.path.realpath(out)
    work = work_folder(target)
    os.makedirs(os.path.dirname(work), exist_ok=True)
    plan = plan_digest(source, shard_size, seed)
    done = set(claim(work, out, plan, clean))
    todo = [(work, split, name, positions, bad_images) for split, name, positions in jobs if name not in done]
    total = sum(len(p) for _, _, p in jobs)
    progress = Progress(total, total - sum(len(job[3]) for job in todo), progress_interval)
    finished = len(done)
    try:
        for name, written, left_out in _run(source, todo, workers):
            finished += 1
            progress.add(written + len(left_out))
        progress.add(0, final=True)
        info = _info(source, jobs, work)
        from ..atomic import write_text_atomically
        write_text_atomically(os.path.join(work, '_info.json'), json.dumps(info, indent=1))
        for _, name, _ in jobs:
            os.unlink(os.path.join(work, name + '.json'))
        os.unlink(os.path.join(work, _OWNER))
        if os.path.dirname(work) == target:
            _move_into(work, target)        # a mounted OUT: the work folder is inside it
        else:
            if os.path.isdir(target):
                os.rmdir(target)             # empty (checked above)
            os.rename(work, target)
    except KeyboardInterrupt as e:        # what the CLI's interrupt line says (not its training wording)
        _release(work, plan)
        e.said = (f'OUT {out} is not written; the {finished} finished shard(s) are kept in {work}: the same command '
                  'resumes from them (--clean removes them)')
        raise
    except BaseException as e:
        kept = f'the {finished} finished shard(s) are kept in {work}: the same command resumes from them (--clean ' \
               'removes them)'
        if not finished:
            shutil.rmtree(work, ignore_errors=True)
            kept = 'nothing is kept'
        else:
            _release(work, plan)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UsageError(f'OUT {out}: the disk is full ({e.strerror}); {kept}') from None
        if isinstance(e, UsageError):
            raise UsageError(f'{e}; OUT {out} is not written; {kept}') from None
        raise
    return info


def _check_files_first(source: Source, check: str) -> None:
    """The image folder's cached header check (imagecheck.py) before anything is written: every unreadable file
    named at once, instead of one at a time as the writers decode them."""
    from .imagecheck import cached_check
    from .imagefolder import _name_files
    from .shard_sources import FileSplit
    for name, split in source.splits.items():
        if isinstance(split, FileSplit) and check != 'none':
            bad = cached_check(split.names, check, f'SOURCE {name}')
            if bad:
                raise UsageError(f'SOURCE: {len(bad)} of {len(split)} {name} images cannot be read: {_name_files(bad)}; '
                                 'fix or remove them, or pass --bad-images skip to leave them out')


def _run(source: Source, todo, workers: int):
    """Results of write_one over `todo`, in `workers` forked processes (or in this one)."""
    global _SOURCE
    _SOURCE = source
    try:
        if workers == 1 or len(todo) <= 1:
            for job in todo:
                yield write_one(job)
            return
        import multiprocessing
        with multiprocessing.get_context('fork').Pool(min(workers, len(todo))) as pool:
            yield from pool.imap_unordered(write_one, todo)
    finally:
        _SOURCE = None


def _info(source: Source, jobs, work: str) -> Dict:
    """_info.json: timm's format (splits with filenames, shard_lengths, num_samples) plus classes and left-outs."""
    info = {'name': source.description, 'classes': list(source.classes) if source.classes else None,
            'class_order': source.class_order, 'splits': {}}
    if getattr(source, 'descriptions', None):
        info['class_descriptions'] = list(source.descriptions)
    for split_name, name, _ in jobs:
        with open(os.path.join(work, name + '.json')) as f:
            written = json.load(f)
        split = info['splits'].setdefault(split_name, {'name': split_name, 'num_samples': 0, 'filenames': [],
                                                       'shard_lengths': [], 'left_out': []})
        split['filenames'].append(name)
        split['shard_lengths'].append(written['samples'])
        split['num_samples'] += written['samples']
        split['left_out'] += written['left_out']
    return info


def shard_patterns(out: str, info: Dict) -> str:
    """The --data argument that reads what write_shards wrote."""
    def pattern(split: Optional[Dict]):
        n = len(split['filenames'])
        name = split['name']
        return os.path.join(out, f'{name}-000000.tar' if n == 1 else f'{name}-{{000000..{n - 1:06d}}}.tar')
    val = next((info['splits'][s] for s in ('validation', 'val', 'test') if s in info['splits']), None)
    return 'wds:' + pattern(info['splits']['train']) + (',' + pattern(val) if val else '')
