"""Who may import whom (ARCHITECTURE.md, "Layout"): read from the package's own imports.

The package's modules and subpackages form layers; each may import only from the layers
before it, so data flows one way (the runner hands objects down; nothing below it reaches
back up for the runner, its hooks or the command line).
"""
from __future__ import annotations

import ast
import os.path as osp
from collections.abc import Iterator
from pathlib import Path

import mmengine_deepspeed

PACKAGE = Path(osp.dirname(mmengine_deepspeed.__file__))

# Lowest first. A unit is a top-level module or a subpackage of mmengine_deepspeed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ('version', 'quiet', 'compat'),
    ('ops', 'failure', 'process_memory', 'history', 'random_streams'),
    ('dist',),
    ('config',),
    ('zero',),
    ('engine',),
    ('checkpoint',),
    ('plan',),
    ('strategy',),
    ('hooks', 'message_hub'),
    ('guard',),
    ('data',),
    ('runner',),
    ('plot', 'launch'),
    ('training',),
    ('demo',),
    ('__init__',),  # importing the package registers everything (the CLI does)
    ('cli',),
    ('__main__',),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    """``mmengine_deepspeed.engine.build`` -> ``engine``; the package itself -> ``__init__``."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else '__init__'


def _imports() -> Iterator[tuple[str, str, str]]:
    """(importing file, its unit, imported unit) for every import of the package's own."""
    for path in sorted(PACKAGE.rglob('*.py')):
        relative = path.relative_to(PACKAGE.parent).with_suffix('')
        module = '.'.join(relative.parts)
        package = module if path.name == '__init__.py' else module.rsplit('.', 1)[0]
        module = module.removesuffix('.__init__')
        if module == 'mmengine_deepspeed':
            module = 'mmengine_deepspeed.__init__'
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split('.')[:len(package.split('.')) - node.level + 1]
                    targets = ['.'.join(base + ([node.module] if node.module else []))]
                elif node.module:
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.split('.')[0] == 'mmengine_deepspeed':
                    yield str(relative), _unit(module), _unit(target)


def test_every_unit_has_a_layer() -> None:
    units = {_unit('mmengine_deepspeed.' + '.'.join(p.relative_to(PACKAGE).with_suffix('').parts))
             for p in PACKAGE.rglob('*.py')}
    assert units - set(RANK) == set(), 'add new modules to LAYERS (and ARCHITECTURE.md)'


def test_imports_go_down_the_layers_only() -> None:
    wrong = sorted(f'{where} ({unit}) imports {target}'
                   for where, unit, target in _imports()
                   if target != unit and RANK[target] >= RANK[unit])
    assert wrong == []


def test_the_reader_sees_imports_inside_functions_too() -> None:
    """The test reads function-level imports as well (the CLI imports lazily)."""
    found = {(unit, target) for _, unit, target in _imports()}
    assert ('cli', 'demo') in found and ('runner', 'engine') in found
