"""tools/setup_env.sh's CUDA set-up logic, run with the host preprocessor on stand-in headers.

The CUDA toolkit's include folder is searched first; a header it lacks is linked from the
pip-installed NVIDIA packages into a folder searched after it, and only such a header.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SETUP_ENV = Path(__file__).resolve().parents[1] / 'tools' / 'setup_env.sh'
CXX = next(filter(None, map(shutil.which, ('c++', 'g++', 'clang++'))), None)


def run_setup_function(*args):
    """Runs one function of setup_env.sh (sourcing it defines them and nothing else runs)."""
    return subprocess.run(
        ['bash', '-c', 'source "$1" && shift && "$@"', 'bash', str(SETUP_ENV), *args],
        capture_output=True, text=True)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def headers(tmp_path):
    """A toolkit without cuSPARSE/cuBLAS headers, and a pip package with them and a stale
    duplicate of a toolkit header that must never be used."""
    write(tmp_path / 'toolkit/cuda_runtime_api.h', '#define RUNTIME_FROM_TOOLKIT 1\n')
    write(tmp_path / 'pip_empty/include/.keep', '')
    pip = tmp_path / 'pip/include'
    write(pip / 'cuda_runtime_api.h', '#error the pip copy of a toolkit header was used\n')
    write(pip / 'cusparse.h', '#include <cuda_runtime_api.h>\n')
    write(pip / 'cublas_v2.h', '#include "cublas_api.h"\n#include "cuda_runtime_api.h"\n')
    write(pip / 'cublas_api.h', '#include <cuda_runtime_api.h>\n')
    write(pip / 'curand.h', '#error not included by torch, so never linked\n')
    write(tmp_path / 'torch/ATen/cuda/CUDAContext.h',
          '#include <cusparse.h>\n#include <cublas_v2.h>\n#include <cuda_runtime_api.h>\n'
          '#if !RUNTIME_FROM_TOOLKIT\n#error toolkit header shadowed\n#endif\n')
    write(tmp_path / 'probe.cu', '#include <ATen/cuda/CUDAContext.h>\n')
    return tmp_path


def link(root, search):
    out = root / 'linked'
    return out, run_setup_function(
        'link_missing_headers', str(out), search, CXX, '-E', '-x', 'c++',
        f'-I{root}/torch', f'-I{root}/toolkit', f'-I{out}', str(root / 'probe.cu'),
        '-o', os.devnull)


def test_links_only_the_headers_the_toolkit_lacks(headers):
    assert CXX, 'no C++ compiler on PATH (c++, g++ or clang++)'
    out, result = link(headers, f"{headers / 'pip_empty/include'}:{headers / 'pip/include'}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['cusparse.h', 'cublas_v2.h', 'cublas_api.h']
    assert sorted(os.listdir(out)) == ['cublas_api.h', 'cublas_v2.h', 'cusparse.h']
    for name in os.listdir(out):
        assert os.readlink(out / name) == str(headers / 'pip/include' / name)


def test_a_header_found_nowhere_stops_with_its_name(headers):
    assert CXX, 'no C++ compiler on PATH (c++, g++ or clang++)'
    out, result = link(headers, str(headers / 'pip_empty/include'))
    assert result.returncode != 0
    assert 'header cusparse.h is in none of' in result.stderr
    assert os.listdir(out) == []


@pytest.mark.parametrize('arch_list, key', [
    ('9.0', 'sm90'),
    ('9.0;8.0+PTX', 'sm80-ptx_sm90'),
    ('8.0+PTX 9.0', 'sm80-ptx_sm90'),
    ('8.0;8.0+PTX', 'sm80_sm80-ptx'),
    ('9.0a', 'sm90a'),
])
def test_wheel_cache_key_of_the_arch_list(arch_list, key):
    result = run_setup_function('arch_key', arch_list)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == key
