"""mmdtn: Dynamic Token Normalization and Dual PatchNorm for OpenMMLab dense prediction."""
import os
import os.path as osp
import platform
import re
import sys

from setuptools import find_packages, setup

HERE = osp.dirname(osp.abspath(__file__))


def read_requirements(*names):
    """Requirement lines of requirements/<name>.txt, comments stripped: the one place versions
    live."""
    reqs = []
    for name in names:
        with open(osp.join(HERE, 'requirements', f'{name}.txt')) as f:
            for line in f:
                line = line.split('#', 1)[0].strip()
                if line:
                    reqs.append(line)
    return reqs


def read_readme():
    path = osp.join(HERE, 'README.md')
    if not osp.exists(path):
        return ''
    with open(path) as f:
        return f.read()


def read_version():
    with open(osp.join(HERE, 'mmdtn', 'version.py')) as f:
        return re.search(r"__version__ = '([^']+)'", f.read()).group(1)


def cpu_kernels():
    """The fused CPU kernels of DynamicTokenNorm (torch C++ extension); MMDTN_WITH_OPS=0 skips
    them, and DynamicTokenNorm then runs its PyTorch implementation everywhere."""
    if os.environ.get('MMDTN_WITH_OPS', '1') == '0':
        return {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    linux = sys.platform.startswith('linux')
    # -fno-math-errno lets sqrt vectorize. The kernels are built for the baseline instruction set
    # and for AVX-512 (chosen at run time); tuning for a modern x86-64 core, which changes no
    # instruction set, makes the AVX-512 kernels twice as fast as GCC's generic tuning does.
    flags = ['-O3', '-fno-math-errno'] + (['-fopenmp'] if linux else [])
    if platform.machine().lower() in ('x86_64', 'amd64'):
        flags.append('-mtune=haswell')
    csrc = 'mmdtn/models/layers/dtn/csrc'
    sources = ['ops.cpp', 'token_passes.cpp', 'band_products.cpp', 'fused_rows.cpp', 'avx512.cpp']
    headers = ['common.h', 'kernels.h', 'isa.h', 'vec.h', 'band.h', 'token_math.h']
    ext = CppExtension('mmdtn.models.layers.dtn._cpu_kernels',
                       [f'{csrc}/{name}' for name in sources],
                       depends=[f'{csrc}/{name}' for name in headers + sources[1:4]],
                       extra_compile_args=flags,
                       extra_link_args=['-fopenmp'] if linux else [])
    return dict(ext_modules=[ext], cmdclass={'build_ext': BuildExtension})


setup(
    name='mmdtn',
    version=read_version(),
    description=('Dynamic Token Normalization and Dual PatchNorm backbones for mmdet and '
                 'mmsegmentation'),
    long_description=read_readme(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mmdtn', 'mmdtn.*']),
    python_requires='>=3.9',
    install_requires=read_requirements('torch', 'mmcv', 'runtime'),
    extras_require={'tests': read_requirements('tests')},
    license='Apache-2.0',
    zip_safe=False,
    **cpu_kernels(),
)
