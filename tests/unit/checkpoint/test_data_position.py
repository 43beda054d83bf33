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
