"""mmdtn: Dynamic Token Normalization and Dual PatchNorm for OpenMMLab dense prediction."""
import os.path as osp
import re

from setuptools import find_packages, setup

HERE = osp.dirname(osp.abspath(__file__))


def read_requirements(*names):
    """Requirement lines of requirements/<name>.txt, comments stripped: the one place versions live."""
    reqs = []
    for name in names:
        with open(osp.join(HERE, 'requirements', f'{name}.txt')) as f:
            for line in f:
                line = line.split('#', 1)[0].strip()
                if line:
                    reqs.append(line)
    return reqs


def read_version():
    with open(osp.join(HERE, 'mmdtn', 'version.py')) as f:
        return re.search(r"__version__ = '([^']+)'", f.read()).group(1)


setup(
    name='mmdtn',
    version=read_version(),
    description='Dynamic Token Normalization and Dual PatchNorm backbones for mmdet and mmsegmentation',
    long_description=open(osp.join(HERE, 'README.md')).read() if osp.exists(osp.join(HERE, 'README.md')) else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mmdtn', 'mmdtn.*']),
    python_requires='>=3.9',
    install_requires=read_requirements('torch', 'mmcv', 'runtime'),
    extras_require={'tests': read_requirements('tests')},
    license='Apache-2.0',
    zip_safe=False,
)
