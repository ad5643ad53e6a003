"""The class names a run was trained on: recorded with the run and in every checkpoint (train/), compared with the
data a run is resumed or evaluated on. A model's output k means the run's class k; data that names its classes
in another order (an image folder read by timm's reader instead of torchvision's, a re-sorted synset list)
would be scored against the wrong names without a word, so a difference is refused, naming the first one."""
from typing import Any, Dict, List, Optional


def class_record(extra: Dict[str, Any]) -> Dict[str, Any]:
    """{'classes', 'class_order', 'class_descriptions'} of a DatasetInfo's extra (None where the data has none)."""
    classes = extra.get('classes')
    return {'classes': list(classes) if classes else None, 'class_order': extra.get('class_order'),
            'class_descriptions': list(extra['class_descriptions']) if extra.get('class_descriptions') else None}


def class_mismatch(stored: Optional[List[str]], found: Optional[List[str]], stored_words: Optional[List[str]] = None,
                   found_words: Optional[List[str]] = None) -> Optional[str]:
    """None when the two name lists agree (or either is unknown), else the first difference in words. A class named
    by its id on one side and by its words on the other agrees (`*_words`: the class_descriptions): ImageNet read as
    downloaded names n01440764 'tench, Tinca tinca', the Hub's imagenet-1k names it 'tench, Tinca tinca', in the
    same order; a run on one was refused on the other."""
    if not stored or not found or list(stored) == list(found):
        return None
    if len(stored) == len(found) and all(
            a == b or (found_words and a == found_words[k]) or (stored_words and stored_words[k] == b)
            for k, (a, b) in enumerate(zip(stored, found))):
        return None
    note = normalisation_note(stored, found)
    if note:
        return note
    if sorted(stored) == sorted(found):
        k = next(i for i, (a, b) in enumerate(zip(stored, found)) if a != b)
        return (f'the same {len(stored)} class names in another order: class {k} is {stored[k]!r} for the run, '
                f'{found[k]!r} in the data')
    only_run = [c for c in stored if c not in set(found)]
    only_data = [c for c in found if c not in set(stored)]
    return (f'other classes: {len(stored)} for the run, {len(found)} in the data'
            + (f"; only the run's: {_few(only_run)}" if only_run else '')
            + (f"; only the data's: {_few(only_data)}" if only_data else ''))


def _few(names: List[str]) -> str:
    return ', '.join(repr(n) for n in names[:3]) + (f' and {len(names) - 3} more' if len(names) > 3 else '')


def normalisation_note(a: List[str], b: List[str]) -> Optional[str]:
    """What differs, where two class name lists are the same names in another Unicode normalisation: a folder copied
    on a Mac (or unzipped from an archive made there) names 'éclair' as 'e' + U+0301 (NFD) where Linux keeps U+00E9
    (NFC). The two print alike and sort differently, so a plain comparison showed two lists that looked the same."""
    import unicodedata
    nfc = lambda names: sorted(unicodedata.normalize('NFC', n) for n in names)      # noqa: E731
    if sorted(a) == sorted(b) or nfc(a) != nfc(b):
        return None
    k = next(i for i, (x, y) in enumerate(zip(sorted(a, key=nfc_key), sorted(b, key=nfc_key))) if x != y)
    x, y = sorted(a, key=nfc_key)[k], sorted(b, key=nfc_key)[k]
    return (f'the same class names in another Unicode normalisation: {x!r} is {_form(x)} on one side, {_form(y)} on '
            f'the other ({x.encode("unicode_escape").decode()} vs {y.encode("unicode_escape").decode()}); the two sort '
            'differently, so their class indices differ: rename the folders to one form (NFC, as Linux keeps them: '
            "e.g. convmv -f utf8 -t utf8 --nfc -r --notest DIR)")


def nfc_key(name: str) -> str:
    import unicodedata
    return unicodedata.normalize('NFC', name)


def _form(name: str) -> str:
    import unicodedata
    return 'NFC' if unicodedata.is_normalized('NFC', name) else 'NFD' if unicodedata.is_normalized('NFD', name) \
        else 'neither NFC nor NFD'
