"""Writers killed mid-write (issue 45): `convert` and `export` write OUT through a temporary sibling named for its
process (`structformer.atomic`); after a SIGKILL the temporary stays, is refused as input, and the next command
writing OUT removes it (a folder moved aside while being replaced is put back first). Each case runs the real
command in a process of its own that pauses inside the write and is then killed with SIGKILL."""
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file

from structformer.atomic import prepare_output, stale_temporaries, temporary_sibling
from structformer.cli import main
from structformer.errors import UsageError

from forking import Forked

pytestmark = pytest.mark.usefixtures('one_torch_thread')


def _pausing_inside(target: str, argv):
    """In the child: pause for good once `target` (a dotted function) has run, or once os.replace moved OUT
    aside (`target` 'os.replace'); then run `structformer ARGV`."""
    module, name = target.rsplit('.', 1)
    if name == 'replace':                   # between moving the old OUT aside and renaming the new one in
        real = os.replace

        def replace(src, dst, *a, **k):
            real(src, dst, *a, **k)
            if '.old-' in str(dst):
                print('PAUSED', flush=True)
                time.sleep(600)
        os.replace = replace
    else:
        owner = importlib.import_module(module)
        real = getattr(owner, name)

        def paused(*a, **k):
            real(*a, **k)
            print('PAUSED', flush=True)
            time.sleep(600)
        setattr(owner, name, paused)
    return main(argv)


def _killed_mid_write(target: str, argv) -> int:
    """Run `structformer ARGV` in a process of its own (forked: tests/forking.py) that pauses inside the write;
    SIGKILL it there. Returns its PID."""
    with Forked(_pausing_inside, target, argv) as child:
        child.wait_for_output('PAUSED', timeout=120)
        child.kill()
        assert child.returncode == -signal.SIGKILL
        return child.pid


@pytest.fixture(scope='module')
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp('writers')
    save_file(timm.create_model('vit_digits').state_dict(), str(folder / 'vit.safetensors'))
    return folder / 'vit.safetensors'


def _leftovers(out: Path, pid: int):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f'{out.name}.') and f'-{pid}-' in p.name)


def test_killed_convert_is_cleaned_by_the_next_convert(weights, tmp_path, capsys):
    out = tmp_path / 'converted'
    argv = ['convert', '--from', 'timm', str(weights), '--model', 'vit_digits', '--output', str(out)]
    pid = _killed_mid_write('safetensors.torch.save_file', argv)
    (left,) = _leftovers(out, pid)
    assert left.startswith(f'converted.tmp-{pid}-') and not out.exists()
    # never taken for weights: a reader refuses it, naming the interrupted writer
    from structformer.train.initial_weights import read_weights
    with pytest.raises(UsageError, match=rf'left by process {pid}, which was interrupted; not an output'):
        read_weights(out.parent / left, '--pretrained-path')
    assert main(argv) == 0
    assert f'removed {left}, left by process {pid}' in capsys.readouterr().out
    assert _leftovers(out, pid) == [] and (out / 'model.safetensors').is_file()


def test_killed_export_is_cleaned_and_a_folder_moved_aside_comes_back(weights, tmp_path, capsys):
    source = tmp_path / 'source'
    assert main(['convert', '--from', 'timm', str(weights), '--model', 'vit_digits', '--output', str(source)]) == 0
    out = tmp_path / 'hf'
    argv = ['export', str(source), '--format', 'hf', '--output', str(out)]
    pid = _killed_mid_write('timm.models._hub.save_for_hf', argv)
    (left,) = _leftovers(out, pid)
    assert left.startswith(f'hf.tmp-{pid}-') and not out.exists()
    assert main(['export', str(out.parent / left), '--format', 'hf', '--output', str(tmp_path / 'x')]) == 2
    assert 'not an output' in capsys.readouterr().err
    assert main(argv) == 0 and f'removed {left}' in capsys.readouterr().out
    before = sorted(p.name for p in out.iterdir())
    # killed while replacing OUT (--overwrite): after moving the old folder aside, before renaming the new one in
    pid = _killed_mid_write('os.replace', argv + ['--overwrite'])
    assert not out.exists() and len(_leftovers(out, pid)) == 2          # OUT.old-PID-... and OUT.tmp-PID-...
    assert prepare_output(out, '--output')[0].startswith(f'restored hf from hf.old-{pid}-')
    assert sorted(p.name for p in out.iterdir()) == before and _leftovers(out, pid) == []


def test_a_running_writer_is_not_disturbed_and_a_reused_pid_is_not_believed(tmp_path):
    out = tmp_path / 'out'
    sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    try:
        live = temporary_sibling(out, directory=True)
        live.rename(live.parent / live.name.replace(f'.tmp-{os.getpid()}-', f'.tmp-{sleeper.pid}-'))
        with pytest.raises(UsageError, match=rf'--output {out}: process {sleeper.pid} is writing it now'):
            prepare_output(out, '--output')
        # the same PID on a temporary last written before that process started: another process had the PID
        old = time.time() - 3600
        (stale,) = [p for p in tmp_path.iterdir() if p.name.startswith('out.tmp-')]
        os.utime(stale, (old, old))
        assert stale_temporaries(out) == [stale]
        assert prepare_output(out, '--output') and not stale.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
