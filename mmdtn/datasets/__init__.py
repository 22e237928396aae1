"""Dataset helpers: up-front checks of the datasets a config uses; the demo's synthetic shapes and
the classification crops cut from them."""
from .checks import (DatasetFormatError, DatasetNotFoundError, check_coco_annotations,
                     check_dataset_cfg, check_datasets, dataset_cfgs)
from .shape_crops import ShapeCropsSpec, generate_shape_crops
from .synthetic_shapes import SHAPE_CLASSES, ShapesSpec, generate_shapes_dataset

__all__ = ['DatasetFormatError', 'DatasetNotFoundError', 'check_coco_annotations',
           'check_dataset_cfg', 'check_datasets', 'dataset_cfgs', 'SHAPE_CLASSES', 'ShapesSpec',
           'generate_shapes_dataset', 'ShapeCropsSpec', 'generate_shape_crops']
