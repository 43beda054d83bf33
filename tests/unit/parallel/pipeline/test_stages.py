"""Cutting a model into stages: the models the pipeline refuses, without processes."""

import pytest
import torch

from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.parallel.pipeline.stages import _check_cuttable
from lightning_5d.parallel.pipeline.batch import PipelineError
from lightning_5d.plan import discover


def test_tied_embeddings_cannot_be_cut():
    module = LlamaLM(LlamaConfig(num_layers=2, tie_embeddings=True))
    with pytest.raises(PipelineError, match="tied embeddings"):
        _check_cuttable(module, discover(module))


def test_a_parameter_outside_the_mapped_parts_is_refused():
    module = LlamaLM(LlamaConfig(num_layers=2))
    module.temperature = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(PipelineError, match="temperature"):
        _check_cuttable(module, discover(module))
