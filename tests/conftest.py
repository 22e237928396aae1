"""Shared fixtures."""
import os

import pytest


@pytest.fixture(params=['cpu_kernels', 'pytorch'])
def dtn_implementation(request, monkeypatch):
    """Runs a test with DynamicTokenNorm's fused CPU kernels and with its PyTorch implementation
    (the one other devices use)."""
    import mmdtn.models.layers.dynamic_token_norm as dtn_module
    if request.param == 'cpu_kernels' and dtn_module._native_ops is None:
        if os.environ.get('MMDTN_WITH_OPS') == '0':
            pytest.skip('mmdtn was installed with MMDTN_WITH_OPS=0, without its CPU kernels')
        pytest.fail('the CPU kernels of DynamicTokenNorm are not built: run `pip install -e .` '
                    '(or `make install`) with a C++ compiler')
    monkeypatch.setattr(dtn_module, 'USE_CPU_KERNELS', request.param == 'cpu_kernels')
    return request.param
