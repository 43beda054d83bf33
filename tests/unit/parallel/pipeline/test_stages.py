"""Cutting a model into stages: the models the pipeline refuses, without processes."""

import pytest
import torch

from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.config import PipelineSchedule
from lightning_5d.parallel.pipeline.cuttable import check_cuttable
from lightning_5d.parallel.pipeline.tied import check_tied_schedule, tied_names
from lightning_5d.parallel.pipeline.batch import PipelineError
from lightning_5d.plan import discover


def test_tied_embeddings_are_cut_with_the_shared_weight_named_on_both_ends():
    module = LlamaLM(LlamaConfig(num_layers=2, tie_embeddings=True))
    plan = discover(module)
    check_cuttable(module, plan)  # no longer refused
    tied = tied_names(module.get_submodule(plan.embedding), module.get_submodule(plan.head))
    assert tied == [("weight", "weight")]
    untied = LlamaLM(LlamaConfig(num_layers=2))
    assert tied_names(untied.get_submodule(plan.embedding), untied.get_submodule(plan.head)) == []


def test_a_weight_shared_inside_a_submodule_of_the_head_is_refused():
    embedding = torch.nn.Embedding(8, 4)
    head = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False))
    head[0].weight = embedding.weight
    with pytest.raises(PipelineError, match="share a parameter inside a submodule"):
        tied_names(embedding, head)


def test_a_parameter_outside_the_mapped_parts_is_refused():
    module = LlamaLM(LlamaConfig(num_layers=2))
    module.temperature = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(PipelineError, match="temperature"):
        check_cuttable(module, discover(module))


def test_tied_embeddings_under_a_v_schedule_are_refused_with_a_schedule_that_works():
    module = LlamaLM(LlamaConfig(num_layers=2, tie_embeddings=True))
    plan = discover(module)
    tied = tied_names(module.get_submodule(plan.embedding), module.get_submodule(plan.head))
    for schedule in (PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV):
        with pytest.raises(PipelineError, match="schedule=interleaved_1f1b"):
            check_tied_schedule(tied, schedule, plan)
    check_tied_schedule(tied, PipelineSchedule.INTERLEAVED_1F1B, plan)  # the advice: tested in test_pipeline.py
    check_tied_schedule([], PipelineSchedule.ZBV, plan)


def test_a_part_on_another_stage_says_so_when_its_weight_is_read():
    # A step reading the embedding's weight on the last stage met a bare "'_Placeholder' object has
    # no attribute 'weight'"; it stays an AttributeError (hasattr() is False) that says why.
    from lightning_5d.parallel.pipeline.stages import _Placeholder

    stand_in = _Placeholder("model.embed_tokens", runtime=None, produces_activation=True)
    assert not hasattr(stand_in, "weight") and stand_in.name == "model.embed_tokens"
    with pytest.raises(AttributeError, match=r"model.embed_tokens.weight: model.embed_tokens is on another pipeline"):
        stand_in.weight
