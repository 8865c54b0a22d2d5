"""Data: sources and tokenizers, `python -m train.data prepare`, and the step-indexed pipeline.

`make_pipeline` and `abstract_batch` live in train/data/pipeline.py (imported on first use, so that
`prepare` and its worker processes never import JAX). A user's own iterable of batches
(`Trainer(cfg, data=...)`) goes through train/data/external.py's IterableData instead, which gives
it the pipeline's interface.
"""


def make_pipeline(*args, **kwargs):
    from train.data.pipeline import make_pipeline as make

    return make(*args, **kwargs)


def abstract_batch(*args, **kwargs):
    from train.data.pipeline import abstract_batch as abstract

    return abstract(*args, **kwargs)
