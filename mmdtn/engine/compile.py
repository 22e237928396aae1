"""``compile`` in a config: mmengine's Runner compiles ``model.train_step``; what that needs.

With ``compile = True`` (or a dict of ``torch.compile`` arguments, e.g. ``dict(backend='eager')``)
mmengine's Runner wraps ``model.train_step`` in ``torch.compile`` when training starts. Dynamo
cannot capture ``train_step`` in one graph (mmengine's ``stack_batch`` and mmdet's assigners and
samplers break it), so it compiles what that step calls frame by frame: the data preprocessor, the
detector's forward (backbone with its DTN layers, neck, head), the loss code and the optimizer
step. Frames whose shapes change with every batch (mmdet's loss code; the optimizer step while a
scheduler changes the learning rate) recompile until ``torch._dynamo.config.recompile_limit`` and
then run eagerly, so the first iterations are slow.

One thing stops the step outright: with a ``paramwise_cfg`` (every PVT, Swin and DTN config has
one) mmengine's ``DefaultOptimWrapperConstructor`` hands the parameter groups to the optimizer
through a ``ConfigDict``, so ``optimizer.param_groups`` holds ``ConfigDict`` objects, and dynamo's
optimizer tracing (torch 2.x ``torch/_dynamo/variables/optimizer.py``) handles plain dicts only:
the first compiled ``optimizer.step()`` stops with ``InternalTorchDynamoError: AttributeError:
'UserDefinedDictVariable' object has no attribute 'items'`` (any ``dict`` subclass does this).
:func:`prepare_compiled_training` builds the optimizer before the Runner compiles and turns its
parameter groups into plain dicts with the same contents.
"""
from mmengine.optim import OptimWrapperDict

__all__ = ['compile_options', 'plain_param_groups', 'prepare_compiled_training']


def compile_options(cfg):
    """The ``torch.compile`` arguments that mmengine's Runner takes from ``cfg.compile`` (``{}``
    for ``True``), or None when the config does not compile."""
    options = cfg.get('compile', None)
    if options is None or options is False:
        return None
    options = {} if options is True else dict(options)
    return None if options.get('disable', False) else options


def plain_param_groups(optim_wrapper):
    """Replace every parameter group of the optimizer(s) in ``optim_wrapper`` that is a ``dict``
    subclass (mmengine's ``ConfigDict``) by a plain ``dict`` with the same entries, in place.

    Returns the number of groups replaced.
    """
    wrappers = (optim_wrapper.values() if isinstance(optim_wrapper, OptimWrapperDict)
                else [optim_wrapper])
    replaced = 0
    for wrapper in wrappers:
        groups = wrapper.optimizer.param_groups
        for i, group in enumerate(groups):
            if type(group) is not dict:
                groups[i] = dict(group)
                replaced += 1
    return replaced


def prepare_compiled_training(runner):
    """When ``runner.cfg`` compiles, build the runner's optimizer now (``runner.train()`` reuses
    it) with plain-dict parameter groups, and log what mmengine will compile. Does nothing when
    the config does not compile."""
    options = compile_options(runner.cfg)
    if options is None or runner.optim_wrapper is None:  # no training: runner.train() says so
        return
    runner.optim_wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
    replaced = plain_param_groups(runner.optim_wrapper)
    args = ', '.join(f'{k}={v!r}' for k, v in options.items())
    runner.logger.info(
        f'compile: mmengine compiles model.train_step with torch.compile({args}); dynamo '
        'compiles the preprocessor, the forward (DTN layers included), the losses and the '
        'optimizer step frame by frame, recompiling shape-dependent frames in the first '
        f'iterations. {replaced} optimizer parameter groups turned from ConfigDict into dict, '
        "which dynamo's optimizer tracing needs.")
