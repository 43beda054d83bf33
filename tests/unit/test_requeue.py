"""SLURM auto-requeue, one process: the signal flag, the command, the callback in a short fit, the configs.

The multi-process run (signal mid-epoch, save, ``scontrol``, resume to the same losses) is
tests/distributed/test_requeue.py.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import threading

import lightning as L
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_5d.requeue import (
    AutoRequeue,
    RequeueConfig,
    RequeueConfigError,
    RequeueError,
    RequeueOutcome,
    ResumeMode,
    SignalFlag,
    command_argv,
    job_setup,
    parse_signals,
    resume_checkpoint,
    resume_mode,
    run_command,
)

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_JOB_NAME")  # fmt: skip


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    """Tests run inside SLURM jobs too; each sets the variables it wants."""
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """``scontrol`` first on PATH, appending its arguments to a file; ``calls()`` reads them back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\nexit "${{FAKE_SCONTROL_EXIT:-0}}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda: calls.read_text().splitlines() if calls.exists() else []


# --------------------------------------------------------------------------- the flag


def test_handler_only_sets_the_flag_and_restore_puts_back_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        before = signal.getsignal(signal.SIGUSR1)
        flag = SignalFlag(["SIGUSR1"])
        assert flag.install() and flag.owns(signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == signal.SIGUSR1
        assert seen == [], "the previous handler is not chained: the flag is all a signal does"
        flag.restore()
        assert signal.getsignal(signal.SIGUSR1) is before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_restore_leaves_a_handler_installed_after_ours_alone():
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        flag = SignalFlag(["SIGUSR2"])
        flag.install()
        theirs = signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # someone else's, set later
        assert theirs is flag
        flag.restore()
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        assert not flag.installed
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_off_the_main_thread_nothing_is_installed():
    flag, result = SignalFlag(), []
    thread = threading.Thread(target=lambda: result.append(flag.install()))
    thread.start(), thread.join()
    assert result == [False] and not flag.installed


@pytest.mark.parametrize("spec", ["SIGUSR1", "USR1", "usr1", int(signal.SIGUSR1), signal.SIGUSR1])
def test_signal_names(spec):
    assert parse_signals([spec]) == (signal.SIGUSR1,)


def test_signal_errors():
    with pytest.raises(RequeueConfigError, match="unknown signal 'SIGFOO'"):
        parse_signals(["SIGFOO"])
    with pytest.raises(RequeueConfigError, match="cannot be caught"):
        parse_signals(["SIGKILL"])
    with pytest.raises(RequeueConfigError, match="empty"):
        parse_signals([])
    assert parse_signals("SIGTERM") == (signal.SIGTERM,)
    assert parse_signals(["SIGTERM", "TERM", "SIGUSR1"]) == (signal.SIGTERM, signal.SIGUSR1)


# --------------------------------------------------------------------------- the command


def test_command_formatting():
    assert command_argv("scontrol requeue {job_id}", "4242") == ["scontrol", "requeue", "4242"]
    assert command_argv(["scontrol", "requeue", "{job_id}"], "4242") == ["scontrol", "requeue", "4242"]
    # split like a shell, without one: quotes group, other braces and $ stay as written
    assert command_argv("sh -c 'echo {job_id} {other} $HOME'", "7") == ["sh", "-c", "echo 7 {other} $HOME"]
    assert command_argv("touch requeue-me", None) == ["touch", "requeue-me"]  # needs no job id


def test_command_errors():
    with pytest.raises(RequeueConfigError, match=r"needs \{job_id\}"):
        command_argv("scontrol requeue {job_id}", None)
    with pytest.raises(RequeueConfigError, match="empty"):
        command_argv("  ", "1")


def test_run_command_reports_failures():
    assert run_command(["true"]) == (0, "")
    assert run_command(["sh", "-c", "echo nope >&2; exit 3"]) == (3, "nope")
    code, text = run_command(["no-such-program-l5d"])
    assert code == 127 and "no-such-program-l5d" in text
    assert run_command(["sleep", "5"], timeout_s=0.2)[0] == 124


# --------------------------------------------------------------------------- the callback in a fit


class SignalAt(L.Callback):
    """Sends ``signum`` to this process inside optimizer step ``step`` (before its backward)."""

    def __init__(self, signum, step):
        self.signum, self.step, self.handlers = signum, step, {}

    def on_before_backward(self, trainer, pl_module, loss):
        self.handlers[trainer.global_step] = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def fit(tmp_path, *callbacks, ckpt_path=None, max_steps=6, plugins=None, **kwargs):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
        plugins=plugins,
        **kwargs,
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


def test_signal_saves_requeues_with_the_job_id_and_stops(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    requeue, sender = AutoRequeue(tmp_path / "rq"), SignalAt(signal.SIGUSR1, 2)
    trainer = fit(tmp_path, sender, requeue)
    assert requeue.outcome == RequeueOutcome.REQUEUED and trainer.global_step == 3
    assert requeue.saved == tmp_path / "rq" / "requeue-step=3.ckpt" and requeue.saved.exists()
    assert fake_scontrol() == ["requeue 4242"]
    assert AutoRequeue.resume_path(tmp_path / "rq") == requeue.saved
    # Ours during training, over Lightning's SIGTERM handler; the earlier ones back after fit.
    assert all(h is requeue.flag for h in sender.handlers[1].values())
    assert {s: signal.getsignal(s) for s in before} == before


def test_accumulation_waits_for_the_optimizer_step(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")

    class SignalAtBatch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 4:  # the first micro-batch of step 2 (3 per step)
                os.kill(os.getpid(), signal.SIGTERM)

    requeue = AutoRequeue(tmp_path / "rq", check_every_n_steps=1)
    trainer = fit(tmp_path, SignalAtBatch(), requeue, accumulate_grad_batches=3)
    assert trainer.global_step == 2 and requeue.saved.name == "requeue-step=2.ckpt"
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == 6  # stopped at a step boundary


def test_check_every_n_steps(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    requeue = AutoRequeue(tmp_path / "rq", check_every_n_steps=4)
    trainer = fit(tmp_path, SignalAt(signal.SIGUSR1, 0), requeue, max_steps=10)
    assert trainer.global_step == 4 and requeue.saved.name == "requeue-step=4.ckpt"


def test_without_a_job_id_it_saves_warns_and_stops(tmp_path, fake_scontrol):
    requeue = AutoRequeue(tmp_path / "rq")
    with pytest.warns(UserWarning, match="SLURM_JOB_ID is not set, so there is no job to requeue"):
        trainer = fit(tmp_path, SignalAt(signal.SIGTERM, 1), requeue)
    assert requeue.outcome == RequeueOutcome.SAVED_NO_JOB and trainer.global_step == 2
    assert requeue.saved.exists() and fake_scontrol() == []


def test_a_failing_command_raises_after_the_save(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("FAKE_SCONTROL_EXIT", "5")
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    requeue = AutoRequeue(tmp_path / "rq")
    with pytest.raises(RequeueError, match=r"'scontrol requeue 4242' failed with exit code 5.*requeue-step=2\.ckpt"):
        fit(tmp_path, SignalAt(signal.SIGUSR1, 1), requeue)
    assert (tmp_path / "rq" / "requeue-step=2.ckpt").exists() and fake_scontrol() == ["requeue 4242"]
    assert {s: signal.getsignal(s) for s in before} == before, "a failed fit leaves no handler of ours behind"


def test_resume_continues_from_the_requeue_checkpoint(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    assert AutoRequeue.resume_path(tmp_path / "rq") is None  # a first start
    fit(tmp_path, SignalAt(signal.SIGUSR1, 1), AutoRequeue(tmp_path / "rq"))
    again = AutoRequeue(tmp_path / "rq")
    trainer = fit(tmp_path, again, ckpt_path=AutoRequeue.resume_path(tmp_path / "rq"))
    assert trainer.global_step == 6 and again.outcome is None and fake_scontrol() == ["requeue 1"]


def test_lightning_slurm_auto_requeue_does_not_handle_the_signal_too(tmp_path, fake_scontrol, monkeypatch):
    for name, value in dict(SLURM_JOB_ID="4242", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
                            SLURM_NODEID="0", SLURM_JOB_NAME="train").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    requeue = AutoRequeue(tmp_path / "rq")
    slurm = SLURMEnvironment(auto_requeue=True)  # Lightning's own handler saves and requeues inside the handler
    fit(tmp_path, SignalAt(signal.SIGUSR1, 1), requeue, plugins=[slurm])
    assert fake_scontrol() == ["requeue 4242"], "requeued once, by AutoRequeue"
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt")), "Lightning's handler did not save"


def test_a_signal_after_the_last_step_requeues_nothing(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")

    class SignalAtEnd(L.Callback):
        def on_train_end(self, trainer, pl_module):
            os.kill(os.getpid(), signal.SIGUSR1)

    requeue = AutoRequeue(tmp_path / "rq")
    trainer = fit(tmp_path, SignalAtEnd(), requeue, max_steps=2)
    assert trainer.global_step == 2 and requeue.outcome is None and fake_scontrol() == []


@pytest.mark.parametrize("limits", [{"max_steps": 3}, {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 3}])
def test_a_signal_in_the_last_step_requeues_nothing(tmp_path, fake_scontrol, monkeypatch, capsys, limits):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    requeue = AutoRequeue(tmp_path / "rq")
    trainer = fit(tmp_path, SignalAt(signal.SIGUSR1, 2), requeue, **limits)
    assert trainer.global_step == 3 and requeue.outcome is None and requeue.saved is None and fake_scontrol() == []
    assert "SIGUSR1 arrived during or after the last step" in capsys.readouterr().out


def test_callback_arguments_are_checked():
    with pytest.raises(RequeueConfigError, match="check_every_n_steps=0"):
        AutoRequeue("x", check_every_n_steps=0)
    with pytest.raises(RequeueConfigError, match="unknown signal"):
        AutoRequeue("x", signals=["SIGNOPE"])
    with pytest.raises(RequeueConfigError, match="empty"):
        AutoRequeue("x", command="")


# --------------------------------------------------------------------------- l5d train


def test_requeue_config_and_job_setup(tmp_path, monkeypatch):
    with pytest.raises(RequeueConfigError, match=r"unknown keys \['signal'\]"):
        RequeueConfig.from_mapping({"signal": "SIGUSR1"})
    with pytest.raises(RequeueConfigError, match="enabled='yes'"):
        RequeueConfig.from_mapping({"enabled": "yes"})
    off = job_setup({"requeue": {"enabled": False, "dirpath": str(tmp_path)}, "resume": "auto"})
    assert off.callbacks == [] and off.plugins == [] and off.ckpt_path is None

    on = {"requeue": {"enabled": True, "dirpath": str(tmp_path), "signals": ["SIGUSR2"]}, "resume": "none"}
    setup = job_setup(on)
    assert [type(c) for c in setup.callbacks] == [AutoRequeue] and setup.callbacks[0].signals == (signal.SIGUSR2,)
    assert setup.plugins == []  # not under srun: Lightning does not pick SLURMEnvironment
    for name, value in dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NAME="train").items():
        monkeypatch.setenv(name, value)
    (plugin,) = job_setup(on).plugins
    assert isinstance(plugin, SLURMEnvironment) and plugin.auto_requeue is False  # ours handles the signal
    assert job_setup(on, plugins=[TorchElasticEnvironment()]).plugins == []  # the worker's choice stays
    setup.callback.flag.restore()
    for other in (job_setup(on), job_setup(on, plugins=[TorchElasticEnvironment()])):
        other.callback.flag.restore()


# --------------------------------------------------------------------------- signals before fit


def test_a_signal_before_fit_is_acted_on_at_the_first_step(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    requeue = AutoRequeue(tmp_path / "rq")
    requeue.install()  # first thing in the script
    os.kill(os.getpid(), signal.SIGTERM)  # during imports or setup: the default action would end the process
    trainer = fit(tmp_path, requeue)
    assert requeue.outcome == RequeueOutcome.REQUEUED and trainer.global_step == 1
    assert requeue.saved.name == "requeue-step=1.ckpt" and fake_scontrol() == ["requeue 7"]
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_during_the_checkpoint_restore_is_acted_on_after_it(tmp_path, fake_scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    saved = tmp_path / "step=3.ckpt"
    fit(tmp_path, max_steps=3).save_checkpoint(saved)

    class SignalInRestore(L.Callback):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            os.kill(os.getpid(), signal.SIGUSR1)

    requeue = AutoRequeue(tmp_path / "rq")
    requeue.install()
    trainer = fit(tmp_path, SignalInRestore(), requeue, ckpt_path=saved)
    assert requeue.outcome == RequeueOutcome.REQUEUED and trainer.global_step == 4
    assert requeue.saved.name == "requeue-step=4.ckpt" and fake_scontrol() == ["requeue 7"]


def test_the_workers_start_up_catcher_hands_its_signals_to_the_requeue_handler(tmp_path):
    from lightning_5d import worker_boot

    caught = []
    original = signal.signal(signal.SIGUSR2, lambda n, f: caught.append(n))
    try:
        early = worker_boot.catch("SIGUSR1,SIGUSR2")
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert early[1] == [signal.SIGUSR1, signal.SIGUSR2] and caught == []  # recorded only
        on = {"requeue": {"enabled": True, "dirpath": str(tmp_path), "signals": ["SIGUSR1"]}, "resume": "none"}
        setup = job_setup(on, early=early)
        flag = setup.callback.flag
        assert flag.received == signal.SIGUSR1 and signal.getsignal(signal.SIGUSR1) is flag
        # SIGUSR2 is not a requeue signal here: its own handler is back and got it after all.
        assert caught == [signal.SIGUSR2]
        flag.restore()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # what was there before the catcher
        # Requeue off: every handler goes back, and a signal caught meanwhile is delivered again.
        early = worker_boot.catch("SIGUSR2")
        os.kill(os.getpid(), signal.SIGUSR2)
        job_setup({"requeue": {"enabled": False, "dirpath": str(tmp_path)}, "resume": "none"}, early=early)
        assert caught == [signal.SIGUSR2, signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, original)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_after_fit_leaves_without_a_result_under_submitit(tmp_path, monkeypatch):
    setup = job_setup({"requeue": {"enabled": True, "dirpath": str(tmp_path)}})
    setup.after_fit()  # nothing happened
    setup.callback.outcome = RequeueOutcome.REQUEUED
    setup.after_fit()  # not under submitit: fit returns, the process exits 0
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    with pytest.raises(SystemExit) as exit_:
        setup.after_fit()
    assert exit_.value.code == 0


def test_resume_modes(tmp_path):
    assert [resume_mode(x) for x in ("auto", "AUTO", "none", None, "a/b.ckpt")] == [
        ResumeMode.AUTO, ResumeMode.AUTO, ResumeMode.NONE, ResumeMode.NONE, ResumeMode.PATH]  # fmt: skip
    assert resume_checkpoint("auto", tmp_path / "missing") is None
    assert resume_checkpoint("auto", tmp_path) is None
    (tmp_path / "requeue-step=3.ckpt").write_bytes(b"x")
    (tmp_path / "requeue-step=12.ckpt").write_bytes(b"x")
    assert resume_checkpoint("auto", tmp_path) == tmp_path / "requeue-step=12.ckpt"
    assert resume_checkpoint("none", tmp_path) is None
    assert resume_checkpoint(str(tmp_path / "requeue-step=3.ckpt"), "x") == tmp_path / "requeue-step=3.ckpt"
    with pytest.raises(RequeueConfigError, match="no such checkpoint"):
        resume_checkpoint(str(tmp_path / "nope.ckpt"), tmp_path)


def test_l5d_train_validates_requeue_keys_before_launch():
    from lightning_5d.train import ConfigError, compose, validate

    cfg = compose([])
    assert cfg.requeue.enabled is False and cfg.resume == "auto"
    assert list(cfg.requeue.signals) == ["SIGUSR1", "SIGTERM"]
    validate(cfg)
    with pytest.raises(ConfigError, match="unknown signal 'SIGFOO'"):
        validate(compose(["requeue.signals=[SIGFOO]"]))
    with pytest.raises(ConfigError, match="check_every_n_steps=0"):
        validate(compose(["requeue.check_every_n_steps=0"]))
    with pytest.raises(ConfigError, match="no such checkpoint"):
        validate(compose(["resume='/nonexistent/step=1.ckpt'"]))


def test_slurm_recipe_signals_agree_with_the_launcher():
    """The signal submitit asks SLURM for is one AutoRequeue handles, early enough, on a requeueable job."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    slurm = pytest.importorskip("submitit.slurm.slurm")
    from lightning_5d.train import compose, validate

    cfg = compose(["recipe=slurm_requeue"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm_requeue"
    assert launcher._target_.endswith("SlurmLauncher")
    assert cfg.requeue.enabled is True and cfg.resume == "auto"
    validate(cfg)

    # The sbatch header submitit writes for this launcher config.
    sbatch = slurm._make_sbatch_string(
        command="python -m submitit.core._submit x",
        folder="/tmp/l5d-submitit",
        time=launcher.timeout_min,
        nodes=cfg.num_nodes,
        ntasks_per_node=launcher.tasks_per_node,
        gpus_per_node=launcher.gpus_per_node,
        signal_delay_s=launcher.signal_delay_s,
        additional_parameters=dict(launcher.additional_parameters),
    )
    (name, delay) = re.search(r"#SBATCH --signal=(?:B:)?(\w+)@(\d+)", sbatch).groups()
    assert parse_signals([name])[0] in parse_signals(list(cfg.requeue.signals)), (name, list(cfg.requeue.signals))
    assert signal.SIGTERM in parse_signals(list(cfg.requeue.signals))  # preemption, scancel, the limit itself
    assert 0 < int(delay) < launcher.timeout_min * 60
    assert "#SBATCH --requeue" in sbatch.splitlines()  # scontrol requeue needs a requeueable job
    assert launcher.max_num_timeout > 0
    assert launcher.tasks_per_node == launcher.gpus_per_node == cfg.devices  # one task per GPU, rank in-process
    assert f"#SBATCH --ntasks-per-node={cfg.devices}" in sbatch.splitlines()
