"""Shards at ImageNet scale (data/shards.py, data/tars.py): samples are dealt, not only shards, so an epoch reads
every sample once at any shard / process / worker count; damage inside a tar (a garbage header half-way, a shard
cut at a block boundary, fewer samples than _info.json says) is one line naming the shard, or under
bad_images=skip named and counted, never a silently shorter epoch."""
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from structformer.data import build_datasets
from structformer.data import shards as shards_module


def _png(k: int) -> bytes:
    """A 2x2 PNG whose first pixel encodes k (R + 256 G)."""
    from PIL import Image
    pixels = np.zeros((2, 2, 3), np.uint8)
    pixels[0, 0] = (k % 256, k // 256, 0)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, 'PNG')
    return out.getvalue()


def pixel_id(image):
    r, g, _ = image.getpixel((0, 0))
    return torch.tensor(r + 256 * g)


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, lengths, split='train', start=0, info=True):
    """Shards `split-00000k.tar` of `lengths` samples with ids start, start+1, ...; their _info.json."""
    folder.mkdir(parents=True, exist_ok=True)
    k, names = start, []
    for s, n in enumerate(lengths):
        names.append(f'{split}-{s:06d}.tar')
        with tarfile.open(folder / names[-1], 'w', format=tarfile.USTAR_FORMAT) as tar:
            for _ in range(n):
                _add(tar, f'{k:06d}.png', _png(k))
                _add(tar, f'{k:06d}.cls', str(k % 3).encode())
                k += 1
    if info:
        path = folder / '_info.json'
        old = json.loads(path.read_text()) if path.exists() else {'classes': ['a', 'b', 'c'], 'splits': {}}
        old['splits'][split] = {'name': split, 'filenames': names, 'shard_lengths': list(lengths),
                                'num_samples': sum(lengths)}
        path.write_text(json.dumps(old))
    return k


class _Worker:
    def __init__(self, id, num_workers):
        self.id, self.num_workers = id, num_workers


def read_slots(stream, epoch, world, workers, monkeypatch):
    """{(rank, worker): [ids]} of one epoch, each slot iterated as its loader worker would iterate it."""
    stream.set_epoch(epoch)
    out = {}
    for rank in range(world):
        stream.configure(rank, world)
        for w in range(workers):
            monkeypatch.setattr(shards_module, 'get_worker_info', lambda w=w: _Worker(w, workers))
            out[rank, w] = [int(x) for x, _ in stream]
    return out


def _stream(folder: Path, n_train: int, **kw):
    pattern = f"{folder}/train-{{000000..{n_train - 1:06d}}}.tar,{folder}/validation-000000.tar"
    train, _, _ = build_datasets(f'wds:{pattern}', train_transform=pixel_id, shuffle_buffer=3, **kw)
    return train


@pytest.mark.parametrize('lengths, world, workers', [
    ((4,) * 6, 2, 2),           # 6 shards on 4 slots: whole-shard dealing read 2/3 of them twice, 1/3 never
    ((3,) * 7, 1, 4),
    ((5,) * 5, 2, 2),           # 25 samples on 2 processes: 12 each, 1 left out of each epoch
    ((1, 7, 3, 5, 2), 2, 2),    # unequal shards
    ((9, 2), 1, 2),             # as many shards as slots, very unequal
    ((6, 2, 9), 2, 2),          # fewer shards (3) than slots (4)
])
def test_every_sample_once_per_epoch_at_any_counts(lengths, world, workers, tmp_path, monkeypatch):
    n = write_shards(tmp_path, lengths)
    write_shards(tmp_path, (2,), 'validation', start=n)
    stream = _stream(tmp_path, len(lengths))
    orders = []
    for epoch in (1, 2):
        slots = read_slots(stream, epoch, world, workers, monkeypatch)
        ids = [i for got in slots.values() for i in got]
        per_process = [sum(len(slots[r, w]) for w in range(workers)) for r in range(world)]
        assert per_process == [n // world] * world                     # equal steps on every process (DDP)
        assert len(ids) == len(set(ids)) == world * (n // world)      # nobody reads a sample twice
        assert set(ids) <= set(range(n))
        if n % world == 0:
            assert sorted(ids) == list(range(n))                       # every sample, once
        orders.append(slots)
    assert orders[0] != orders[1]                                        # each epoch its own order
    assert read_slots(stream, 1, world, workers, monkeypatch) == orders[0]   # and the same order again



@pytest.mark.parametrize('lengths, world, workers', [((1, 7, 3, 5, 2), 3, 2), ((5,) * 7, 2, 3)])
def test_each_slot_opens_only_the_shards_its_run_covers(lengths, world, workers, tmp_path, monkeypatch):
    """Shard and slot counts that do not divide (18 samples in 5 unequal shards on 3 x 2 slots; 35 in 7 on 2 x 3): a
    (process, worker) slot opens the shards its run of the sequence covers, no other (the stream adds no work per
    process); over all slots the opens are the shards plus at most one per boundary of the runs and the left-out gap."""
    from structformer.data import tars
    n = write_shards(tmp_path, lengths)
    write_shards(tmp_path, (2,), 'validation', start=n)
    stream = _stream(tmp_path, len(lengths))
    opened, real = [], tars.open_tar
    monkeypatch.setattr(tars, 'open_tar', lambda url, *a: opened.append(url) or real(url, *a))
    monkeypatch.setattr(shards_module, 'read_shard', tars.read_shard)
    stream.set_epoch(1)
    total = 0
    for rank in range(world):
        stream.configure(rank, world)
        for w in range(workers):
            monkeypatch.setattr(shards_module, 'get_worker_info', lambda w=w: _Worker(w, workers))
            opened.clear()
            got = [int(x) for x, _ in stream]
            start, stop = stream.slot_range(w, workers)
            cut, gap = stream.left_out_at(1), n % world
            covered = {stream.urls[k] for lo, hi in ((start, min(stop, cut)), (max(start, cut) + gap, stop + gap))
                       if lo < hi for k, _, _ in stream.segments(1, lo, hi)}
            assert got and sorted(set(opened)) == sorted(covered)
            total += len(opened)
    assert total <= len(lengths) + world * workers - 1 + (n % world > 0)

def test_the_left_over_samples_are_said_and_differ_by_epoch(tmp_path, monkeypatch, capsys):
    n = write_shards(tmp_path, (5,) * 5)
    write_shards(tmp_path, (2,), 'validation', start=n)
    stream = _stream(tmp_path, 5)
    shards_module.stream_loader(stream, batch_size=4, workers=0, rank=0, world_size=2, drop_last=False)
    assert '25 samples an epoch over 2 processes: each takes 12; 1 are left out' in capsys.readouterr().out
    missing = [set(range(n)) - {i for got in read_slots(stream, e, 2, 2, monkeypatch).values() for i in got}
               for e in (1, 2, 3, 4)]
    assert all(len(m) == 1 for m in missing) and len(set.union(*missing)) > 1


def test_the_left_over_samples_differ_by_epoch_from_a_single_shard(tmp_path, monkeypatch):
    """One shard (e.g. held-out samples): the N % P cut were always its last samples, never trained on."""
    n = write_shards(tmp_path, (7,))
    write_shards(tmp_path, (2,), 'validation', start=n)
    stream = _stream(tmp_path, 1)
    epochs = [read_slots(stream, e, 3, 2, monkeypatch) for e in (1, 2, 3, 4, 5)]
    missing = [set(range(n)) - {i for got in slots.values() for i in got} for slots in epochs]
    assert all(len(m) == 1 for m in missing) and len(set.union(*missing)) > 1, missing
    for slots in epochs:                       # still 2 each (7 // 3), nobody reads a sample twice
        assert [sum(len(slots[r, w]) for w in range(2)) for r in range(3)] == [2, 2, 2]
        assert len({i for got in slots.values() for i in got}) == 6


def test_lengths_come_from_the_header_scan_without_an_info_file(tmp_path, monkeypatch, capsys):
    n = write_shards(tmp_path, (4, 1, 6), info=False)
    write_shards(tmp_path, (2,), 'validation', start=n, info=False)
    stream = _stream(tmp_path, 3)
    assert 'counted 11 training samples in the headers of 3 shards' in capsys.readouterr().out
    assert stream.lengths == [4, 1, 6] and stream.lengths_from == 'the header scan'
    slots = read_slots(stream, 1, 1, 2, monkeypatch)
    assert sorted(i for got in slots.values() for i in got) == list(range(n))


# ----------------------------------------------------------------------------- damage inside a tar

def _damaged(folder: Path, how: str) -> Path:
    """Shard train-000001.tar of three damaged `how`; all three are 4 samples per _info.json."""
    n = write_shards(folder, (4, 4, 4))
    write_shards(folder, (2,), 'validation', start=n)
    path = folder / 'train-000001.tar'
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    if how == 'garbage header':            # the header of the 3rd sample's image overwritten: size stays a multiple
        at = members[4].offset
        data[at:at + 512] = b'\x07' * 512
    elif how == 'cut at a block':            # ends after the 2nd sample, on a 512-byte boundary, no end blocks
        data = data[:members[4].offset]
    elif how == 'fewer than stated':        # a whole, valid tar of 3 samples where _info.json says 4
        with tarfile.open(path) as tar:
            kept = [(m, tar.extractfile(m).read()) for m in members[:6]]
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode='w', format=tarfile.USTAR_FORMAT) as tar:
            for m, payload in kept:
                _add(tar, m.name, payload)
        data = out.getvalue()
    assert len(data) % 512 == 0
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize('how, needle', [('garbage header', 'is damaged: the block at byte'),
                                         ('cut at a block', 'ends early'),
                                         ('fewer than stated', 'holds 3 samples; _info.json says 4')])
def test_a_shard_damaged_mid_file_stops_the_epoch_naming_it(how, needle, tmp_path, monkeypatch):
    path = _damaged(tmp_path, how)
    stream = _stream(tmp_path, 3)
    with pytest.raises(ValueError) as caught:
        read_slots(stream, 1, 1, 2, monkeypatch)
    message = str(caught.value)
    assert str(path) in message and needle in message and 'bad_images=skip' in message, message
    assert '\n' not in message


@pytest.mark.parametrize('how', ['garbage header', 'cut at a block', 'fewer than stated'])
def test_under_skip_a_damaged_shard_is_named_counted_and_replaced(how, tmp_path, monkeypatch, capsys):
    path = _damaged(tmp_path, how)
    stream = _stream(tmp_path, 3, bad_images='skip')
    slots = read_slots(stream, 1, 1, 2, monkeypatch)
    ids = [i for got in slots.values() for i in got]
    assert len(ids) == 12                                      # the quota holds: the epoch is not shorter
    lost = {4 + k for k in range(4)} - set(ids)
    assert lost                                                # the damaged shard's tail is gone ...
    out = capsys.readouterr().out
    assert str(path) in out and 'damaged shard(s) met by this loader process' in out   # ... and said


@pytest.mark.parametrize('how', ['garbage header', 'cut at a block'])
def test_the_header_scan_refuses_a_damaged_shard(how, tmp_path, capsys):
    from structformer.cli import main
    path = _damaged(tmp_path, how)
    (tmp_path / '_info.json').unlink()                          # so the training shards are counted by a scan
    rc = main(['train', '--model', 'crate_digits', '--data', f"wds:{tmp_path}/train-{{000000..000002}}.tar,"
               f"{tmp_path}/validation-000000.tar", '--output', str(tmp_path / 'run'), '--no-progress'])
    err = capsys.readouterr().err
    assert rc == 2 and str(path) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('workers', [0, 2])
def test_an_epoch_resumed_after_k_batches_gives_the_rest_of_the_same_epoch(workers, tmp_path):
    """A recovery point mid-epoch: each worker replays what it gave through its shuffle buffer (undecoded) and goes
    on; the loader then yields exactly the batches a straight epoch yields after the first k."""
    n = write_shards(tmp_path, (5, 2, 6))             # 13 samples: the workers give 4 and 3 batches of 2
    write_shards(tmp_path, (2,), 'validation', start=n)
    stream = _stream(tmp_path, 3)
    loader, order, batches = shards_module.stream_loader(stream, batch_size=2, workers=workers, rank=0, world_size=1,
                                                         drop_last=False)
    order.set_epoch(3)
    full = [x.tolist() for x, _ in loader]
    assert len(full) == batches and sorted(i for b in full for i in b) == list(range(n))
    for k in range(1, batches):
        order.resume_at(k, 2)
        assert [x.tolist() for x, _ in loader] == full[k:], k
    order.resume_at(0, 2)
    assert [x.tolist() for x, _ in loader] == full
