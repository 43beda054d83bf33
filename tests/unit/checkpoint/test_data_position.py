"""The train dataloader's position: a mid-epoch resume draws the batches not trained on yet."""

from types import SimpleNamespace

from torch.utils.data import DataLoader

from lightning_5d.checkpoint.data_position import ResumableLoader


def _trainer(epoch=0, processed=0, last=False):
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed), is_last_batch=last)
    return SimpleNamespace(
        current_epoch=epoch, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
    )


def test_state_is_the_epoch_and_the_batches_processed():
    loader = ResumableLoader(DataLoader(list(range(10)), batch_size=2), _trainer(epoch=1, processed=3))
    assert loader.state_dict() == {"epoch": 1, "batches": 3, "finished": 0}
    assert len(loader) == 5 and loader.batch_size == 2  # what Lightning reads passes through


def test_resuming_mid_epoch_skips_what_was_trained_once():
    trainer = _trainer(epoch=1)
    loader = ResumableLoader(DataLoader(list(range(10)), batch_size=2), trainer)
    loader.load_state_dict({"epoch": 1, "batches": 3, "finished": 0})
    assert [b.tolist() for b in loader] == [[6, 7], [8, 9]]
    assert len(list(loader)) == 5  # the next epoch starts at its beginning


def test_a_checkpoint_from_the_last_batch_or_another_epoch_skips_nothing():
    for state, epoch in (
        ({"epoch": 1, "batches": 5, "finished": 1}, 1),
        ({"epoch": 0, "batches": 2, "finished": 0}, 1),
    ):
        loader = ResumableLoader(DataLoader(list(range(10)), batch_size=2), _trainer(epoch=epoch))
        loader.load_state_dict(state)
        assert len(list(loader)) == 5


def test_a_resume_in_a_later_epoch_skips_within_that_epochs_order():
    # Lightning asks for the iterator before it calls set_epoch: the skipped draws must still
    # come from the resumed epoch's permutation, not epoch 0's.
    from torch.utils.data import DistributedSampler

    data = list(range(16))

    def loader():
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))

    uninterrupted = loader()
    uninterrupted.sampler.set_epoch(1)
    expected = [b.tolist() for b in uninterrupted][3:]
    resumed = ResumableLoader(loader(), _trainer(epoch=1))
    resumed.load_state_dict({"epoch": 1, "batches": 3, "finished": 0})
    assert [b.tolist() for b in resumed] == expected


def test_attributes_lightning_sets_reach_the_loader():
    inner = DataLoader(list(range(4)))
    wrapped = ResumableLoader(inner, _trainer())
    wrapped.worker_init_fn = print
    assert inner.worker_init_fn is print
