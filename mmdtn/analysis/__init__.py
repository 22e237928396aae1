"""Shared parts of the analysis tools in ``tools/analysis/`` (the DTN paper's figures and tables).

The tools reproduce the analyses of Shao et al., "Dynamic Token Normalization Improves Vision
Transformers" (ICLR 2022): token magnitude (Fig. 1), mean attention distance (Fig. 2, appendix B.1),
variation coefficient (Fig. 3b), gates (Fig. 4), positional attention P^h (Figs. 7-8) and complexity
(Tables 1, 2, 9, 12). This package holds what they share:

* :mod:`.models`: build a backbone or a whole model from a config, load and check a checkpoint,
  find DTN layers and transformer blocks;
* :mod:`.images`: images from a folder (or synthetic ones), normalized as the config says;
* :mod:`.capture`: forward hooks that record block-norm inputs/outputs and attention inputs;
* :mod:`.attention`: attention weights recomputed from the modules' own parameters, with the query
  and key positions, and the mean attention distance;
* :mod:`.flops`: the complexity report (parameters and FLOPs, DTN by the formula of
  :mod:`mmdtn.models.layers.dtn.flops`);
* :mod:`.plotting` and :mod:`.cli`: matplotlib (Agg) helpers and the common command line.

It is imported by the tools directly and is not needed by ``import mmdtn``.
"""
