"""Dataset helpers: up-front checks of the datasets a config uses; the demo's synthetic shapes."""
from .checks import (DatasetFormatError, DatasetNotFoundError, check_coco_annotations,
                     check_dataset_cfg, check_datasets, dataset_cfgs)
from .synthetic_shapes import SHAPE_CLASSES, ShapesSpec, generate_shapes_dataset

__all__ = ['DatasetFormatError', 'DatasetNotFoundError', 'check_coco_annotations',
           'check_dataset_cfg', 'check_datasets', 'dataset_cfgs', 'SHAPE_CLASSES', 'ShapesSpec',
           'generate_shapes_dataset']
