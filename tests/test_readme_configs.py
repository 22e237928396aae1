"""The configs the READMEs name exist and build, and every shipped config is in a family's table.

The results tables of README.md and configs/*/README.md link their configs; each linked config
parses (mmengine's ``Config.fromfile``, ``_base_`` chain and all) and its model's and backbone's
types resolve in the registry of the config's scope. Building the models is
tests/test_configs.py's job; this only checks that the tables point at configs that are there.
Every config path written anywhere in the documentation (``configs/....py``) must exist too.
"""
import functools
import glob
import os.path as osp
import re
from importlib import import_module

import pytest
from mmengine.config import Config
from mmengine.registry import init_default_scope

import mmdtn  # noqa: F401
from tiny_datasets import CONFIGS, iter_config_files

ROOT = osp.dirname(CONFIGS)
#: The top README, then the family folders' READMEs.
TABLE_READMES = [osp.join(ROOT, 'README.md')] + sorted(
    glob.glob(osp.join(CONFIGS, '*', 'README.md')))
LINK = re.compile(r'\]\(([^)\s]+\.py)\)')
CONFIG_PATH = re.compile(r'configs/[\w./-]+\.py')


def table_configs(readme):
    """The configs linked from the table rows of a markdown file, as absolute paths."""
    here = osp.dirname(readme)
    found = []
    for line in open(readme, encoding='utf-8'):
        if line.lstrip().startswith('|'):
            found += [osp.normpath(osp.join(here, link)) for link in LINK.findall(line)]
    return found


LINKED = sorted({(osp.relpath(r, ROOT), c) for r in TABLE_READMES for c in table_configs(r)})


def _docs():
    """Every markdown file of the repository outside virtual environments and outputs."""
    skip = ('.venv', '.git', 'work_dirs', 'data', 'build', '.device')
    return sorted(p for p in glob.glob(osp.join(ROOT, '**', '*.md'), recursive=True)
                  if osp.relpath(p, ROOT).split(osp.sep)[0] not in skip)


@functools.lru_cache(maxsize=None)
def _load(path):
    return Config.fromfile(path)


def test_every_readme_has_a_table_of_configs():
    for readme in TABLE_READMES:
        assert table_configs(readme), f'{readme} links no config from a table'


@pytest.mark.parametrize('readme, path', LINKED,
                         ids=[f'{r}:{osp.relpath(p, CONFIGS)}' for r, p in LINKED])
def test_table_config_exists_and_builds(readme, path):
    assert osp.isfile(path), f'{readme} links {path}, which does not exist'
    cfg = _load(path)
    assert cfg.default_scope in ('mmdet', 'mmseg', 'mmpretrain')
    init_default_scope(cfg.default_scope)
    registry = import_module(f'{cfg.default_scope}.registry').MODELS
    for what, type_name in (('model', cfg.model.type), ('backbone', cfg.model.backbone.type)):
        assert registry.get(type_name) is not None, \
            f'{osp.relpath(path, ROOT)}: {what} type {type_name!r} is not registered'


def test_every_shipped_config_is_in_a_family_table():
    """Every config but the top-level short name is linked from its own folder's README."""
    in_tables = {c for r in TABLE_READMES if osp.dirname(r) != ROOT for c in table_configs(r)}
    shipped = {p for p in iter_config_files() if osp.dirname(p) != CONFIGS}
    assert shipped - in_tables == set(), 'configs in no family table'
    for readme in TABLE_READMES[1:]:
        for path in table_configs(readme):
            assert osp.dirname(path) == osp.dirname(readme), f'{readme} links {path}'


@pytest.mark.parametrize('doc', _docs(), ids=lambda p: osp.relpath(p, ROOT))
def test_config_paths_in_the_docs_exist(doc):
    text = open(doc, encoding='utf-8').read()
    missing = sorted({p for p in CONFIG_PATH.findall(text) if not osp.isfile(osp.join(ROOT, p))
                      and '{' not in p})
    assert not missing, f'{osp.relpath(doc, ROOT)} names configs that do not exist: {missing}'
