"""A stand-in for the strategy's ContextParallel, enough for ``route_positions``: one shard
current, forwards wrapped and unwrapped as cp does (shared by the position-read tests)."""

from types import SimpleNamespace

from lightning_5d.parallel.context.batch import SequenceShard


def fake_cp(positions, seq_len):
    shard = SequenceShard(batch=None, seq_len=seq_len, positions=positions, labels=None)
    state = SimpleNamespace(current=shard, size=2, undo=[])

    def wrap_forward(module, sharded):
        original = module.forward
        module.forward = lambda *a, **k: sharded(original, *a, **k) if state.current is not None else original(*a, **k)
        state.undo.append(lambda: delattr(module, "forward"))

    state.wrap_forward = wrap_forward
    return state
