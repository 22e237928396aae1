"""Dataset helpers: up-front checks of the datasets a config uses."""
from .checks import (DatasetFormatError, DatasetNotFoundError, check_coco_annotations,
                     check_dataset_cfg, check_datasets, dataset_cfgs)

__all__ = ['DatasetFormatError', 'DatasetNotFoundError', 'check_coco_annotations',
           'check_dataset_cfg', 'check_datasets', 'dataset_cfgs']
