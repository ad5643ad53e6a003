"""Run one measurement in a fresh Python process, so peak-memory readings of different
configurations never mix, and read back the JSON line it prints last."""
import json
import subprocess
import sys


class MeasurementFailed(RuntimeError):
    def __init__(self, returncode: int, stderr: str):
        super().__init__(f"exit {returncode}: {stderr.strip()[-1500:]}")
        self.returncode = returncode


def python_json(code: str) -> dict:
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=False)
    if out.returncode:
        raise MeasurementFailed(out.returncode, out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])
