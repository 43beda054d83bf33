"""`l5d train` refuses pipeline layouts the model or the batch cannot take, before any worker starts."""

import pytest

from lightning_5d.config import LayoutError
from lightning_5d.parallel.pipeline.batch import PipelineError
from lightning_5d.train import compose, validate


def test_the_pipeline_recipe_validates():
    assert validate(compose(["recipe=tiny_pp"])).pp == 2


def test_more_stages_than_layers():
    with pytest.raises(LayoutError, match="the model has 4 blocks but pp=2 x virtual_stages=4 needs at least 8"):
        validate(compose(["recipe=tiny_pp", "parallel.pipeline.virtual_stages=4", "parallel.pipeline.microbatches=2",
                          "data.batch_size=4"]))  # fmt: skip


def test_batch_that_does_not_split_into_microbatches():
    with pytest.raises(PipelineError, match="data.batch_size=6 does not split into pipeline.microbatches=4"):
        validate(compose(["recipe=tiny_pp", "data.batch_size=6"]))


def test_schedule_that_needs_two_stages_per_rank():
    with pytest.raises(LayoutError, match="dualpipev places exactly 2 stages per rank"):
        validate(
            compose(["recipe=tiny_pp", "parallel.pipeline.schedule=dualpipev", "parallel.pipeline.virtual_stages=1"])
        )
