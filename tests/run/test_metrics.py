"""rudax.run.MetricsLog and read_metrics: a resumed run's log reads as one run; plot_losses
draws a PNG."""

from rudax.run import MetricsLog, plot_losses, read_metrics


def test_metrics_log_on_resume_drops_the_rows_logged_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 8):  # a session that crashed after logging update 7
        log.write(kind="train", step=step, loss=1.0 / step)
        if step % 3 == 0:
            log.write(kind="eval", step=step, val_loss=2.0 / step)
    log.close()
    log = MetricsLog(path, resume_step=6)  # its last checkpoint was update 6
    log.write(kind="train", step=7, loss=0.5)
    log.write(kind="end", step=7, loss=0.5)
    log.close()
    rows = read_metrics(path)
    assert [(r["kind"], r["step"]) for r in rows] == [
        *[("train", s) for s in (1, 2, 3)],
        ("eval", 3),
        *[("train", s) for s in (4, 5, 6)],
        ("eval", 6),
        ("train", 7),
        ("end", 7),
    ]
    assert rows[-2]["loss"] == 0.5


def test_plot_losses_writes_a_png(tmp_path):
    rows = [{"kind": "train", "step": s, "loss": 3.0 / s} for s in range(1, 5)]
    rows.append({"kind": "eval", "step": 4, "val_loss": 1.0})
    plot_losses(rows, tmp_path / "loss.png", title="a run")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_log_that_is_not_the_writer_reads_and_writes_nothing(tmp_path):
    # a process other than 0 of a multi-process run: process 0 keeps the one log
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 5, "loss": 1.0}\n')
    log = MetricsLog(path, resume_step=2, tensorboard=tmp_path / "tb", writer=False)
    log.write(kind="train", step=3, loss=2.0)
    log.close()
    assert path.read_text() == '{"kind": "train", "step": 5, "loss": 1.0}\n'
    assert not (tmp_path / "tb").exists()
