"""The plumbing of the GPU check's one-question probes (tools/gpu_tf32.py, tools/gpu_profile.py): their two
arguments, the device, a JSON record that says what ran where, and a run of named parts under a time budget in
which one part's failure is recorded instead of losing the others, the record rewritten atomically after each part
so that a probe stopped at its limit keeps what it measured."""
from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

from ..records import write_json

# (section of the record, label, the measurement, an optional line to print of its result)
Part = Tuple[str, str, Callable[[], dict], Optional[Callable[[dict], str]]]


def probe_arguments(description: str, default_budget_s: float, argv=None) -> argparse.Namespace:
    """--output (the JSON record) and --budget-s (no new part starts after it; > 0), refused in one line, exit 2."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument('--output', required=True)
    p.add_argument('--budget-s', type=float, default=default_budget_s,
                   help=f'start no new part after this many seconds (default {default_budget_s:g})')
    args = p.parse_args(argv)
    if not args.budget_s > 0:
        p.error(f'--budget-s must be > 0, got {args.budget_s}')
    return args


def probe_device() -> torch.device:
    return torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def probe_record(script: str, argv, device: torch.device, sections: List[str], **fields) -> dict:
    """The record's head (the command as run, the device's name, torch) with `fields`, an empty dict per section
    and an empty error list."""
    args = sys.argv[1:] if argv is None else argv
    name = torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor() or 'cpu'
    return dict({'command': f'python3 {script} ' + ' '.join(args), 'device': name, 'torch': torch.__version__},
                **fields, **{section: {} for section in sections}, errors=[])


def run_parts(record: dict, parts: List[Part], budget_s: float, output, device: torch.device) -> int:
    """Each part in turn until `budget_s` has passed (the rest are recorded as not run): its result goes to
    record[section][label], a failure to record['errors']; the record is written after every part. 0 when any
    part measured something, else 1."""
    start = time.perf_counter()
    for section, label, run, show in parts:
        if time.perf_counter() - start > budget_s:
            record['errors'].append(f'{section} {label}: not run (budget)')
            continue
        try:
            row = record[section][label] = run()
            print(show(row) if show else f'{section} {label} {row}', flush=True)
        except Exception as e:                                  # one part's failure must not lose the rest
            record['errors'].append(f'{section} {label}: {type(e).__name__}: {str(e)[:200]}')
        if device.type == 'cuda':
            torch.cuda.empty_cache()
        write_json(output, record)
    record['wall_s'] = time.perf_counter() - start
    write_json(output, record)
    return 0 if any(record[section] for section in {part[0] for part in parts}) else 1
