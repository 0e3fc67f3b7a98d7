"""Reading a run's metrics while verl's file logger writes them: a step's line is read whole or not at all."""

from __future__ import annotations

from verl.utils.tracking import FileLogger

from gepo_plugin.tiny import read_metrics


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path, monkeypatch):
    """verl's own file logger writes two steps; the file cut inside the second line (what a reader sees while the
    line is written) reads as the first step alone, and whole again as both."""
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    writer = FileLogger("p", "e")
    writer.log({"critic/score/mean": 0.25, "hetero/trained": 4.0}, step=1)
    writer.log({"critic/score/mean": 0.5, "hetero/trained": 8.0}, step=2)
    writer.finish()
    whole = path.read_bytes()
    assert read_metrics(path) == {
        1: {"critic/score/mean": 0.25, "hetero/trained": 4.0},
        2: {"critic/score/mean": 0.5, "hetero/trained": 8.0},
    }
    first_end = whole.index(b"\n") + 1
    for cut in (first_end + 1, first_end + 20, len(whole) - 1):
        path.write_bytes(whole[:cut])
        assert read_metrics(path) == {1: {"critic/score/mean": 0.25, "hetero/trained": 4.0}}, cut
    path.write_bytes(whole[: first_end - 5])  # the first line half written: nothing yet
    assert read_metrics(path) == {}
