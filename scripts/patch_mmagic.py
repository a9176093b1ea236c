"""Patch the installed MMagic 1.2.0 for the real-client tier (scripts/setup_openmmlab.sh).

Two upstream bugs stop MMagic 1.2.0 before any runner is built, with MMEngine's
``Runner`` as with ours; the tier works around them here, never in the package:

* ``mmagic/utils/trans_utils.py`` names ``np.bool8``, which NumPy 2 removed
  (``np.bool_`` is the same type); MMagic's ``tools/train.py`` imports it first.
* ``DCGANDiscriminator.init_weights`` passes ``init_info`` to ``update_init_info``
  for every module, but sets it only for convolutions and BatchNorms: the first
  module it visits (the discriminator itself) raises ``UnboundLocalError``
  (mmagic#2109). The patch gives other modules an ``init_info`` that says they keep
  theirs; they change no weight, so MMEngine records nothing for them.

Idempotent: a patched file is left as it is.
"""
from __future__ import annotations

import importlib.util
import os.path as osp
import sys

# file: [(the unpatched text, what replaces it)]; a file whose unpatched text is gone and
# whose replacement is there is patched already.
PATCHES = {
    'utils/trans_utils.py': [('    np.bool_: (False, True),\n    np.bool8: (False, True),\n',
                              '    np.bool_: (False, True),\n')],
    'models/editors/dcgan/dcgan_discriminator.py': [(
        '            module_name = m.__class__.__name__\n'
        '            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):\n',
        '            module_name = m.__class__.__name__\n'
        "            init_info = f'{module_name} keeps its initialization.'\n"
        '            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):\n')],
}


def main() -> int:
    spec = importlib.util.find_spec('mmagic')
    if spec is None or not spec.submodule_search_locations:
        print('patch_mmagic: mmagic is not installed', file=sys.stderr)
        return 1
    root = spec.submodule_search_locations[0]
    for relative, replacements in PATCHES.items():
        path = osp.join(root, relative)
        with open(path, encoding='utf-8') as f:
            text = f.read()
        for old, new in replacements:
            if old in text:
                text = text.replace(old, new)
            elif new not in text:
                print(f'patch_mmagic: {path} has neither the text to patch nor the patch: '
                      'another MMagic version?', file=sys.stderr)
                return 1
        with open(path, 'w', encoding='utf-8') as f:
            f.write(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
