"""Run timm's training script with mmdtn's timm DTN models registered, the script unchanged.

    python tools/timm_train.py PATH/TO/pytorch-image-models/train.py --model pvt_v2_b0_dtn [ARGS]
    torchrun --nproc_per_node=8 tools/timm_train.py PATH/TO/train.py --model pvt_v2_b2_dtn [ARGS]

train.py is timm's own (it is not part of the timm package: it lives in timm's repository, at the
tag of the installed timm version). Every argument after its path goes to it unchanged; DTN's
settings go through ``--model-kwargs`` (e.g. ``--model-kwargs dtn_init=layernorm``). The models:
``pvt_v2_b0_dtn``, ``pvt_v2_b1_dtn``, ``pvt_v2_b2_dtn``, ``swin_tiny_patch4_window7_224_dtn``
(see mmdtn/models/timm_dtn.py), ``vit_tiny_patch16_224_dtn``, ``vit_small_patch16_224_dtn``,
``vit_base_patch16_224_dtn`` (mmdtn/models/timm_vit_dtn.py).
"""
import os.path as osp
import runpy
import sys

import mmdtn.models.timm_dtn  # noqa: F401  (registers the DTN models in timm)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not argv[0].endswith('.py'):
        sys.exit(__doc__.strip())
    if not osp.isfile(argv[0]):
        sys.exit(f'error: timm training script not found: {argv[0]}')
    sys.argv = argv
    runpy.run_path(argv[0], run_name='__main__')


if __name__ == '__main__':
    main()
