"""Shared fixtures."""
import os
import shutil
import sys
import tempfile

import pytest

# The Triton kernels of DynamicTokenNorm run in Triton's interpreter on CPU tensors (this machine
# has no GPU); set before triton sees its first kernel.
os.environ.setdefault('TRITON_INTERPRET', '1')
# The interpreter runs faster patched (tools/dev/triton_interpreter.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools', 'dev'))
if os.environ['TRITON_INTERPRET'] == '1':
    import triton_interpreter  # noqa: E402
    triton_interpreter.patch_once_per_run()
    triton_interpreter.drop_dead_overflow_checks()
# torch.compile's inductor keeps compiled graphs on disk, keyed by the graph but not by the Python
# of the custom ops in it: a graph compiled around an older version of DTN's ops (what they save
# for backward) would be served again. Each test session compiles into its own folder.
INDUCTOR_CACHE = os.environ['TORCHINDUCTOR_CACHE_DIR'] = tempfile.mkdtemp(prefix='mmdtn-inductor-')


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(INDUCTOR_CACHE, ignore_errors=True)


def _share_the_cores_between_workers():
    """Under pytest-xdist, every worker process and the tools it starts use their share of the
    cores: each would otherwise start a thread per core, and the workers' threads would contend
    for the same cores. Settings made by hand (OMP_NUM_THREADS) are kept."""
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
    if workers < 2 or 'OMP_NUM_THREADS' in os.environ:
        return
    if hasattr(os, 'sched_getaffinity'):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    share = str(max(1, cores // workers))
    os.environ.update(OMP_NUM_THREADS=share, MKL_NUM_THREADS=share)
    import torch
    torch.set_num_threads(int(share))


_share_the_cores_between_workers()

from mmdtn import available_backends, get_dtn_backend, set_dtn_backend  # noqa: E402

#: The DTN backends of a CPU machine. 'cpu' needs the kernels that `pip install -e .` builds. The
#: Triton backend, interpreted, is too slow for every test: test_dtn_triton.py tests it.
CPU_BACKENDS = ['cpu', 'torch']


@pytest.fixture
def backend_setting():
    """Restores DynamicTokenNorm's backend setting after a test that changes it."""
    saved = get_dtn_backend()
    yield
    set_dtn_backend(saved)


@pytest.fixture(params=CPU_BACKENDS)
def dtn_backend(request, backend_setting):
    """Runs a test on every DynamicTokenNorm backend that runs CPU tensors (set with
    ``mmdtn.set_dtn_backend``; restored afterwards). Returns the backend's name."""
    name = request.param
    if name not in available_backends('cpu'):
        if name == 'cpu' and os.environ.get('MMDTN_WITH_OPS') == '0':
            pytest.skip('mmdtn was installed with MMDTN_WITH_OPS=0, without its CPU kernels')
        pytest.fail(f'the {name!r} DynamicTokenNorm backend cannot run here: the CPU kernels are '
                    'built by `pip install -e .` (or `make install`) with a C++ compiler')
    set_dtn_backend(name)
    return name
