"""What a weights file holds, told by its first bytes: the one sniffer that `--initial-checkpoint` / `convert`
(which read torch files through `torch_file`) and `structformer export` (which refuses them) share, so a file is
called a pickle by both or by neither.

* torch.save's zip archive (torch >= 1.6) starts with a zip local-file header, 'PK\\x03\\x04';
* a legacy torch.save file, or any pickle of protocol 2 to 5, with the PROTO opcode 0x80 and its protocol byte
  (torch's legacy format writes protocol 2; a bare `pickle.dump` writes the default protocol, 4 or 5);
* a safetensors file with an 8-byte little-endian header length, smaller than the file, then its JSON header's '{'.

Standard library only: the export command asks before torch is needed.
"""
from pathlib import Path
from typing import Optional, Tuple

__all__ = ['sniff', 'program_archive', 'torch_archive', 'TORCH', 'SAFETENSORS', 'EMPTY']

TORCH, SAFETENSORS, EMPTY = 'torch', 'safetensors', 'empty'
_ZIP_HEADER = b'PK\x03\x04'
_PICKLE_PROTOCOLS = range(2, 6)      # the protocols that open with the PROTO opcode (0 and 1 have no header)


def sniff(path) -> Optional[str]:
    """TORCH, SAFETENSORS or EMPTY (0 bytes) by the file's content, or None where the first bytes match none of
    them (or the file cannot be read): the caller then decides by the name or refuses."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, 'rb') as f:
            head = f.read(9)
    except OSError:
        return None
    if size == 0:
        return EMPTY
    if head[:4] == _ZIP_HEADER or (len(head) >= 2 and head[0] == 0x80 and head[1] in _PICKLE_PROTOCOLS):
        return TORCH
    if len(head) == 9 and head[8:9] == b'{' and 0 < int.from_bytes(head[:8], 'little') < size:
        return SAFETENSORS
    return None


def program_archive(path) -> str:
    """For a zip archive that holds a program or NumPy arrays rather than torch.save's pickled data, a phrase saying
    which, else ''. Both open with the same zip header as torch.save's archive (so `sniff` calls them TORCH), and
    torch.load could only fail on them with 'failed locating file data.pkl' or 'Expected hasRecord("version")':
    torch.export.save's `.pt2` holds an `archive_format` record and serialized graphs; numpy's `.npz` (how Google
    publishes its JAX / Flax ViT and MLP-Mixer checkpoints) holds one `.npy` file per array."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as archive:
            names = {name.rsplit('/', 1)[-1] for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile, ValueError):
        return ''
    if 'archive_format' in names and 'data.pkl' not in names:
        return ("is a torch.export program (a .pt2 archive from torch.export.save or `structformer export --format "
                "torch-export`), a program rather than weights, and is not loaded; give the checkpoint it was "
                "exported from, or save model.state_dict() where it was made")
    if names and 'data.pkl' not in names and all(name.endswith('.npy') for name in names):
        return ("is a NumPy .npz archive (JAX / Flax weights, as Google publishes its ViT and MLP-Mixer checkpoints), "
                "not a torch file, and is not read here; load it into a model of its own layout (timm's "
                "load_checkpoint reads Google's ViT .npz) and give that model's state_dict() saved as safetensors")
    return ''


def torch_archive(path) -> Tuple[bool, str]:
    """(whether `path` is torch.save's, by its first bytes, and `program_archive`'s phrase for it or ''): what a
    reader that takes no pickles says of a file given where a checkpoint belongs (a .pt2 or .npz is no pickle)."""
    torch_file = sniff(path) == TORCH
    return torch_file, program_archive(path) if torch_file else ''
