#!/usr/bin/env bash
# Regenerates the analysis figures of the README (docs/figures/*.png) with tools/analysis/.
#
#   [DATA=data/synthetic_shapes] bash docs/figures/make_figures.sh [WORK_DIR]
#
# WORK_DIR (default work_dirs/demo_mask_rcnn) holds the checkpoint(s) written by tools/demo.py; the
# model is the demo's PVT-Tiny-DTN Mask R-CNN (configs/demo/mask_rcnn_pvt_tiny_dtn_shapes.py) and
# the images are the first 8 of the demo's val split. Without checkpoints the figures show the
# randomly initialized model; without the demo data, synthetic images. Complexity is PVT-Tiny-DTN
# RetinaNet against its LN twin at 224 x 224, the paper's Table 2 setting. The ViT figure is the
# paper's Fig. 2 layout (mean attention distance per head and block, ViT-S* with DTN beside its LN
# twin) for randomly initialized models on two synthetic 224 x 224 images.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
CONFIG=configs/demo/mask_rcnn_pvt_tiny_dtn_shapes.py
WORK=${1:-work_dirs/demo_mask_rcnn}
FIG=docs/figures
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

CKPT=$(ls -1 "$WORK"/*.pth 2>/dev/null | sort -V | tail -n 1 || true)
NCKPT=$(ls -1 "$WORK"/*.pth 2>/dev/null | wc -l || true)
DATA=${DATA:-data/synthetic_shapes}
IMAGES=()
if [ -d "$DATA/val" ]; then
    mkdir -p "$TMP/images"
    for f in $(ls -1 "$DATA"/val/*.png | head -n 8); do ln -s "$(realpath "$f")" "$TMP/images/"; done
    IMAGES=(--images "$TMP/images")
fi
echo "checkpoint: ${CKPT:-none (random initialization)}; images: ${IMAGES[*]:-synthetic}"

$PY tools/analysis/complexity.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py --size 224 224 --out "$TMP/complexity"
$PY tools/analysis/token_magnitude.py $CONFIG $CKPT "${IMAGES[@]}" --out "$TMP/magnitude"
$PY tools/analysis/attention_distance.py $CONFIG $CKPT "${IMAGES[@]}" --out "$TMP/distance"
$PY tools/analysis/positional_attention.py $CONFIG $CKPT --size 128 128 --out "$TMP/positional"
$PY tools/analysis/gates.py $CONFIG ${CKPT:+$([ "$NCKPT" -gt 1 ] && echo "$WORK" || echo "$CKPT")} --out "$TMP/gates"
$PY tools/analysis/variation_coefficient.py $CONFIG $CKPT "${IMAGES[@]}" --out "$TMP/variation"
$PY tools/analysis/attention_distance.py configs/imagenet/vit-s-star-dtn_4xb256_in1k.py --size 224 224 \
    --compare configs/imagenet/vit-s-star-ln_4xb256_in1k.py --out "$TMP/vit_distance"

cp "$TMP/complexity/complexity.png" $FIG/complexity.png
cp "$TMP/magnitude/token_magnitude_stage1.block1.norm1.png" $FIG/token_magnitude.png
cp "$TMP/distance/attention_distance.png" $FIG/attention_distance.png
if [ -n "$CKPT" ]; then
    cp "$TMP/positional/positional_attention_after.png" $FIG/positional_attention.png
else
    cp "$TMP/positional/positional_attention_before.png" $FIG/positional_attention.png
fi
if [ -f "$TMP/gates/gates_trajectory.png" ]; then
    cp "$TMP/gates/gates_trajectory.png" $FIG/gates.png
else
    cp "$TMP/gates/gates.png" $FIG/gates.png
fi
cp "$TMP/variation/variation_coefficient.png" $FIG/variation_coefficient.png
cp "$TMP/vit_distance/attention_distance.png" $FIG/vit_attention_distance.png
ls -l $FIG/*.png
