"""The project's Python files keep one style: flake8 with the settings in .flake8 (lines of at most
100 characters), over every tracked Python file."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked_python_files():
    """The Python files git tracks (a fresh clone's), or None outside a git checkout."""
    try:
        out = subprocess.run(['git', 'ls-files', '*.py'], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.split()


def test_flake8_clean():
    files = tracked_python_files()
    if files is None:
        pytest.skip('not a git checkout: no list of tracked files to check')
    result = subprocess.run([sys.executable, '-m', 'flake8', *files], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, f'flake8 (settings in .flake8):\n{result.stdout}{result.stderr}'
