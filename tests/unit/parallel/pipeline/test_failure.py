"""A training run's failure record on one rank, without processes: what it keeps and how it names it."""

from lightning_5d.parallel.pipeline import PipelineError, PipelinePeerError
from lightning_5d.parallel.pipeline.failure import StepFailures, original_error


def _wrapped(inner: Exception) -> RuntimeError:
    # torch's stage re-raises a forward's error as RuntimeError("... failed to run forward ...") from it
    try:
        try:
            raise inner
        except Exception as err:
            raise RuntimeError("[Stage 1] failed to run forward") from err
    except RuntimeError as outer:
        return outer


def test_the_first_failure_is_kept_as_the_users_own_exception():
    failures = StepFailures()
    assert not failures.failed
    user = FloatingPointError("loss is nan")
    failures.record(_wrapped(user), stage=1, microbatch=0)
    failures.record(ValueError("a stand-in's later trouble"), stage=3, microbatch=2)
    assert failures.failed and failures.own.error is user
    assert failures.own.describe() == "FloatingPointError: loss is nan (stage 1, microbatch 0)"


def test_an_error_outside_the_schedule_names_no_stage():
    failures = StepFailures()
    failures.record(PipelineError("a batch of 6 samples does not split"))
    assert failures.own.describe() == "PipelineError: a batch of 6 samples does not split"


def test_a_runtime_error_of_the_users_own_is_not_unwrapped():
    plain = RuntimeError("user's own")
    assert original_error(plain) is plain


def test_the_peer_error_names_the_failing_rank_and_its_error():
    err = PipelinePeerError(3, "ValueError: bad batch (stage 1, microbatch 0)", "the training step")
    assert err.rank == 3 and isinstance(err, PipelineError)
    assert str(err) == "the pipeline stage on rank 3 failed during the training step: ValueError: bad batch (stage 1, microbatch 0)"
    assert "during the forward (its own error says why)" in str(PipelinePeerError(0, None))
