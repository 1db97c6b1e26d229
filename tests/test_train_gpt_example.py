"""examples/train_gpt.py: the dp x tp training loop matches its single-device run, writes its
loss plot, and resumes from a checkpoint as if never interrupted; it reads losses a few steps
late (so the progress bar keeps moving) and its --help says true defaults."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from .helpers import needs_world_size

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _load_example():
    name = "dtorch_example_train_gpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


train_gpt = _load_example()

# Tiny but complete: two blocks, 4 heads (2 per tp rank), a vocabulary-sharded embedding and head.
TINY = ["--seq-len", "16", "--d-model", "32", "--heads", "4", "--layers", "2", "--batch", "4",
        "--lr", "1e-2", "--log-every", "2", "--no-progress"]


def _args(*extra):
    return train_gpt.parse_args(TINY + list(extra))


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Kernels this small only lose from OpenMP: on a busy 2-core machine two intra-op threads
    made the inline run 5-10x slower (each parallel region waits for a core for its second thread)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(one_intra_op_thread):
    """Losses of the single-device run (plain torch), computed once for every runner."""
    return train_gpt.train(_args("--steps", "4", "--device-count", "1", "--plot", ""))


@needs_world_size(4)  # a 2x2 mesh
def test_dp_tp_training_matches_single_device_writes_plot_and_resumes(runner, reference, tmp_path):
    """One test per runner (plans are re-made for every test, and they are most of the cost)."""
    import dtorch_core as dt

    plot, ckpt = tmp_path / "loss.png", tmp_path / "ckpt"
    # uninterrupted, saving at steps 2 and 4
    full = train_gpt.train(_args("--steps", "4", "--ckpt-every", "2", "--ckpt-dir", str(ckpt), "--plot", str(plot)))
    assert dt.is_initialized()  # the example used the test's session and left it running
    assert len(full) == 4
    assert full == pytest.approx(reference, rel=1e-4), "dp x tp losses differ from the single-device run"
    assert full[-1] < full[0]  # it learns
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-000002", "step-000004"]
    assert train_gpt.latest_checkpoint(ckpt).name == "step-000004"

    # resumed from step 2 into a freshly built model: steps 3 and 4 repeat only if the checkpoint
    # restored the weights and AdamW's state (moments and step count)
    resumed = train_gpt.train(_args("--steps", "4", "--resume", str(ckpt / "step-000002"),
                                    "--ckpt-dir", str(tmp_path / "other"), "--plot", ""))
    assert resumed[:2] == full[:2]  # carried over in the checkpoint
    assert resumed == pytest.approx(full, rel=1e-5), "the resumed run differs from the uninterrupted one"
    assert dt.fallback_counts() == {}


def test_checkpoint_options_fail_clearly_without_the_api(monkeypatch):
    """Until dt.checkpoint exists, asking for checkpoints stops with a message saying why."""
    import dtorch_core

    monkeypatch.delattr(dtorch_core, "checkpoint", raising=False)
    monkeypatch.setitem(sys.modules, "dtorch_core.checkpoint", None)  # makes the import fail
    with pytest.raises(SystemExit, match="needs dtorch_core.checkpoint"):
        train_gpt.checkpoint_api()


def test_mismatched_device_count_is_refused():
    with pytest.raises(SystemExit, match="--device-count 2 but --dp 2 x --tp 2"):
        train_gpt.train(_args("--device-count", "2", "--steps", "1", "--plot", ""))


@needs_world_size(4)
def test_compiled_steps_match_single_device_and_resume(runner, reference, tmp_path):
    """--compile: the step is captured (warm-up, two recordings) and replayed from step 4 on;
    dtorch's AdamW keeps its step count on the workers, and it checkpoints and resumes too."""
    import dtorch_core as dt

    ckpt = tmp_path / "ckpt"
    full = train_gpt.train(_args("--compile", "--steps", "6", "--ckpt-every", "3", "--ckpt-dir", str(ckpt),
                                 "--plot", ""))
    assert full[:4] == pytest.approx(reference, rel=1e-4)  # dtorch's AdamW: float32 bias corrections
    resumed = train_gpt.train(_args("--compile", "--steps", "6", "--resume", str(ckpt / "step-000003"),
                                    "--ckpt-dir", str(tmp_path / "other"), "--plot", ""))
    assert resumed == pytest.approx(full, rel=1e-5)
    assert dt.fallback_counts() == {}


class _FakeLoss:
    """A loss handle that records how many steps had been issued when it was read."""

    issued = 0

    def __init__(self, value):
        self.value = value
        self.read_after = None

    def item(self):
        self.read_after = _FakeLoss.issued
        return self.value


def test_loss_reader_reads_each_loss_lag_steps_late_and_drains():
    reader = train_gpt.LossReader(2, [9.0])  # a resumed run's earlier losses come first
    handles = []
    for step in range(5):
        _FakeLoss.issued = step + 1
        handles.append(_FakeLoss(float(step)))
        reader.push(handles[-1])
        # every step reads one loss, the one issued two steps before: never the newest
        assert reader.values == [9.0] + [float(s) for s in range(max(0, step - 1))]
    assert [h.read_after for h in handles] == [3, 4, 5, None, None]
    assert reader.drain() == [9.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert [h.read_after for h in handles[3:]] == [5, 5]
    eager = train_gpt.LossReader(0)
    eager.push(_FakeLoss(1.5))
    assert eager.values == [1.5]


def test_training_reads_one_lagged_loss_per_step(monkeypatch):
    """In a real run (plain torch, one device) the loop reads a loss every step, two steps late,
    instead of every --log-every steps all at once (which waited for all queued work)."""
    issued, reads = [0], []
    real_batch, real_value = train_gpt.get_batch, train_gpt._value

    def counting_batch(*args, **kwargs):
        issued[0] += 1
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(train_gpt, "get_batch", counting_batch)
    monkeypatch.setattr(train_gpt, "_value", lambda loss: reads.append(issued[0]) or real_value(loss))
    losses = train_gpt.train(_args("--steps", "5", "--device-count", "1", "--plot", "", "--log-every", "10"))
    assert len(losses) == 5
    assert reads == [3, 4, 5, 5, 5]  # losses of steps 1, 2, 3 read after steps 3, 4, 5; the rest at the end


def test_help_states_true_defaults():
    text = train_gpt.build_parser().format_help()
    assert "--progress, --no-progress" in text and "(default: True)" not in text
    for line in text.split("\n  --")[1:]:  # one entry per option
        assert line.count("default") <= 1, line
    assert train_gpt.parse_args([]).progress and not train_gpt.parse_args(["--no-progress"]).progress
