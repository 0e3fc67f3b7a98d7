"""The lab's command line (``gepo-lab`` / ``python -m gepo_plugin.lab``) and the stability lab's ``--live`` mode.

The CLI tests parse, dispatch and run both sub-commands (the stability run is a 3-update simulated run,
about 15 s on a loaded 2-core machine). The live test starts a local Ray session with two sampler actors
(about 40-50 s, most of it Ray and actor start-up and the warm start), marked ``ray``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gepo_plugin.lab import cli, variance

GEPO_LAB = Path(sys.executable).with_name("gepo-lab")
pytestmark = pytest.mark.slow  # runs the lab, its console scripts and (marked ray) its live mode


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def test_subcommands_reuse_each_lab_argument_builder() -> None:
    """Each sub-command has exactly the options of its lab's own entry point (not a hand-kept copy)."""
    from gepo_plugin.lab import paired_cli, stability

    subs = _subparsers(cli.build_parser())
    assert set(subs) == {"stability", "variance", "paired"}
    standalone = {
        "stability": stability.add_stability_arguments(argparse.ArgumentParser()),
        "variance": variance.add_variance_arguments(argparse.ArgumentParser()),
        "paired": paired_cli.add_paired_arguments(argparse.ArgumentParser()),
    }
    for name, parser in subs.items():
        assert _option_strings(parser) == _option_strings(standalone[name]), name


def test_help_at_every_level_explains_every_option() -> None:
    parser = cli.build_parser("gepo-lab")
    top = parser.format_help()
    assert "stability" in top and "variance" in top
    for name, sub in _subparsers(parser).items():
        text = sub.format_help()
        for action in sub._actions:
            assert action.help, f"{name}: {action.dest} has no help"
            for opt in action.option_strings:
                assert opt in text, f"{name} --help does not list {opt}"
    stability_help = " ".join(_subparsers(parser)["stability"].format_help().split())
    assert "NOT bit-reproducible" in stability_help and '"mode": "live"' in stability_help
    from gepo_plugin.lab.stability_config import StabilityConfig

    for name, field in StabilityConfig.model_fields.items():  # generated: one option per field, its help the field's
        option = "--" + name.replace("_", "-")
        assert option in stability_help, option
        assert " ".join(field.description.split()) in stability_help, name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: {stability,variance,paired}"),
        (["simulate"], "invalid choice: 'simulate'"),
        (["stability", "--methods", "ppo"], "invalid choice: 'ppo'"),
        (["stability", "--lags", "-3", "--out", "/nonexistent/never-written"], "lags are max_lag settings >= 0"),
        (["stability", "--preset", "ci", "--prompts-per-step", "6"], "multiple of groups_per_batch"),
        (["stability", "--eval-samples", "-1"], "eval_samples=-1"),
        (["stability", "--time-scale", "0.1"], "only apply with live=true"),
        (["stability", "--live", "--time-scale", "0", "--out", "/nonexistent/never-written"], "time_scale=0.0"),
        (["stability", "--lr", "nan", "--out", "/nonexistent/never-written"], "lr=nan"),
        (["variance", "--grid-points", "1"], "--grid-points must be >= 2"),
        (["variance", "--grid-points", "many"], "invalid int value: 'many'"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv, prog="gepo-lab")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not Path("/nonexistent/never-written").exists()


def test_variance_subcommand_runs(tmp_path: Path, capsys) -> None:
    assert cli.main(["variance", "--out", str(tmp_path), "--grid-points", "5", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "fraction where GEPO variance is higher" in captured.out
    assert captured.err == ""  # --no-progress
    summary = json.loads((tmp_path / "variance_summary.json").read_text())
    assert summary["grid_points"] == 5
    assert summary["bernoulli"]["n_cells"] == 25


def test_every_option_reaches_the_config_it_names() -> None:
    """The generated command line round-trips: a value for every field of the config, given on the command line,
    is exactly the value of the config the run receives (nothing dropped, renamed or silently defaulted)."""
    from gepo_plugin.lab.stability import config_from_args

    parser = _subparsers(cli.build_parser())["stability"]
    argv = [
        *("--preset", "ci", "--seeds", "3", "4", "--methods", "gepo", "gspo", "--lags", "0", "2"),
        *("--max-a", "40", "--max-b", "8", "--eval-fraction", "0.3", "--task-seed", "2", "--format-reward", "0.1"),
        *("--hidden", "32", "--layers", "1", "--heads", "2", "--threads", "2", "--warm-lr", "0.002"),
        *("--warm-batch", "16", "--warm-target", "0.2", "--warm-max-steps", "50", "--warm-check-every", "5"),
        *("--rl-steps", "7", "--lr", "0.002", "--lr-warmup-steps", "3", "--group-size", "4"),
        *("--prompts-per-step", "12", "--groups-per-batch", "3", "--buffer-groups", "20", "--temperature", "0.9"),
        *("--grad-clip", "0.5", "--clip", "0.3", "--eval-every", "2", "--eval-samples", "0"),
        *("--sampler-seconds", "1", "3", "--learner-seconds", "0.25", "--delay-low", "1", "--delay-high", "9"),
        *("--delay-confidence", "0.9", "--strategy", "drop", "--admission-margin", "0"),
        *("--live", "--time-scale", "0.01", "--ray-cpus", "3"),
        *("--guard-enable", "--guard-min-ess", "0.4", "--guard-relax-ess", "0.9", "--guard-patience", "3"),
        *("--guard-floor", "0", "--rollout-correction", "decoupled_seq_is"),
    ]
    config = config_from_args(parser.parse_args(argv)).model_dump()
    expected = {
        **dict(seeds=[3, 4], methods=["gepo", "gspo"], lags=[0, 2], max_a=40, max_b=8, eval_fraction=0.3),
        **dict(task_seed=2, format_reward=0.1, hidden=32, layers=1, heads=2, threads=2, warm_lr=0.002),
        **dict(warm_batch=16, warm_target=0.2, warm_max_steps=50, warm_check_every=5, rl_steps=7, lr=0.002),
        **dict(lr_warmup_steps=3, group_size=4, prompts_per_step=12, groups_per_batch=3, buffer_groups=20),
        **dict(temperature=0.9, grad_clip=0.5, clip=0.3, eval_every=2, eval_samples=0, sampler_seconds=[1.0, 3.0]),
        **dict(learner_seconds=0.25, delay_low=1.0, delay_high=9.0, delay_confidence=0.9, strategy="drop"),
        **dict(admission_margin=0, live=True, time_scale=0.01, ray_cpus=3, rollout_correction="decoupled_seq_is"),
        "guard": dict(enable=True, min_ess=0.4, relax_ess=0.9, patience=3, floor=0),
    }
    assert config == expected  # every field set above, none left out (the dict has all of them)
    assert set(expected) == set(config)
    quick = config_from_args(parser.parse_args([])).model_dump()
    assert quick["live"] is False and quick["rl_steps"] == 150  # the quick preset, simulated, by default


def test_stability_subcommand_runs_simulated(tmp_path: Path, capsys) -> None:
    started = time.perf_counter()
    argv = ["stability", "--preset", "ci", "--methods", "gepo", "--lags", "0", "--rl-steps", "3"]
    argv += ["--eval-every", "3", "--warm-target", "0.1", "--no-progress", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "| gepo | 0 | 1 |" in capsys.readouterr().out
    summary = json.loads((tmp_path / "stability_summary.json").read_text())
    assert summary["mode"] == "simulated" and "live" not in summary
    (run,) = summary["runs"]
    assert run["eval_steps"] == [0, 3] and run["lag_histogram"] == {"0": 48}
    assert "live" not in run
    print(f"simulated CLI run: {time.perf_counter() - started:.1f} s")


def test_console_script_and_module_entry_points() -> None:
    assert GEPO_LAB.is_file(), f"{GEPO_LAB} missing: run `pip install -e .` to install the gepo-lab console script"

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)

    top = run(str(GEPO_LAB), "--help")
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: gepo-lab") and "{stability,variance,paired}" in top.stdout
    sub = run(str(GEPO_LAB), "stability", "--help")
    assert sub.returncode == 0 and "--live" in sub.stdout and "--time-scale" in sub.stdout, sub.stderr
    bad = run(str(GEPO_LAB), "variance", "--grid-points", "1")
    assert bad.returncode == 2 and "--grid-points must be >= 2" in bad.stderr
    module = run(sys.executable, "-m", "gepo_plugin.lab", "--help")
    assert module.returncode == 0 and module.stdout.startswith("usage: python -m gepo_plugin.lab"), module.stderr


def test_live_sampler_tags_versions_and_keeps_its_speed() -> None:
    """The sampler actor's logic without Ray: it generates with the weights it was sent (tagged with their
    version), and a batch takes at least ``seconds * time_scale`` wall seconds."""
    torch = pytest.importorskip("torch")
    from gepo_plugin.lab.stability_live import LiveSampler
    from gepo_plugin.lab.stability_task import build_policy, build_task

    task = build_task()
    model = build_policy(task, seed=0)
    other = build_policy(task, seed=1)
    sampler = LiveSampler(0, 4.0, 0.05, task, build_policy(task, seed=2), 2, 3, 1.0, 0.0)
    assert sampler.start_run(0, 0, model.state_dict()) == os.getpid()
    first = sampler.generate(10, submitted=4)
    assert [grp.group_id for grp in first["groups"]] == ["g00000010", "g00000011"]
    assert {grp.submitted for grp in first["groups"]} == {4}
    assert {grp.version for grp in first["groups"]} == {0} == {first["version"]}
    sampler.load(5, other.state_dict())
    for name, tensor in other.state_dict().items():
        assert torch.equal(sampler.model.state_dict()[name], tensor), name
    started = time.monotonic()
    second = sampler.generate(12)
    assert time.monotonic() - started >= 4.0 * 0.05
    assert {grp.version for grp in second["groups"]} == {5}
    assert all(grp.tokens.shape[0] == 3 for grp in second["groups"])


@pytest.mark.ray
def test_live_mode_two_samplers(tmp_path: Path, monkeypatch) -> None:
    """Two Ray sampler actors, max_lag 1, six learner updates in wall-clock time.

    Why a lag of 1 must occur: ``buffer_groups`` (24) exceeds ``prompts_per_step`` (8), so in the driver
    iteration in which the 8th group arrives, the sampler that delivered it (still holding the learner's
    version v: no newer version exists yet) starts another batch before the learner starts its update at v.
    Those groups can only be trained at v + 1, and the wait strategy makes them be trained there: lag 1.
    """
    pytest.importorskip("ray")
    torch = pytest.importorskip("torch")
    from gepo_plugin.lab import stability, stability_live
    from gepo_plugin.lab.stability_config import resolve

    trained: list[tuple[dict[str, Any], Any]] = []
    original_run = stability_live.LiveCluster.run

    def spy_run(self, setup, *args: Any, **kwargs: Any):
        before = {name: tensor.detach().clone() for name, tensor in setup.model.state_dict().items()}
        record = original_run(self, setup, *args, **kwargs)
        trained.append((before, setup.model))
        return record

    monkeypatch.setattr(stability_live.LiveCluster, "run", spy_run)
    started = time.perf_counter()
    rl_steps, max_lag = 6, 1
    config = resolve(
        "ci",
        dict(
            methods=["gepo"],
            lags=[max_lag],
            live=True,
            time_scale=0.05,
            rl_steps=rl_steps,
            eval_every=3,
            sampler_seconds=[1.0, 2.0],
            prompts_per_step=8,
            buffer_groups=24,
            delay_low=2.0,
            delay_high=20.0,
            warm_target=0.1,
        ),
    )
    summary = stability.run_stability(tmp_path, config, "ci", progress=False)
    elapsed = time.perf_counter() - started

    assert summary["mode"] == "live" and summary["live"]["reproducible"] is False
    (run,) = summary["runs"]
    lags = {int(k): v for k, v in run["lag_histogram"].items()}
    ledger = run["ledger"]
    # every trained group's lag is within the bound (histogram of all trained groups, and per update)
    assert max(lags) <= max_lag and min(lags) >= 0, lags
    assert sum(lags.values()) == ledger["trained"] >= rl_steps * 8
    # nothing lost
    assert ledger["produced"] == ledger["trained"] + ledger["dropped"] + ledger["queued"]
    # the wait strategy never trains or drops a group for its own lag; what it evicts is the excess of urgent
    # groups one batch cannot hold (buffer_groups 24 > prompts_per_step 8), under that reason only
    assert ledger["dropped/stale"] == 0 and ledger["dropped/failed"] == 0, ledger
    assert ledger["dropped"] == ledger["dropped/stale_overflow"], ledger
    # real staleness happened (see the docstring for why it must)
    assert lags.get(1, 0) > 0, lags
    # the samplers were separate processes, and both contributed
    live = run["live"]
    assert len(set(live["sampler_pids"])) == 2 and os.getpid() not in live["sampler_pids"]
    assert all(n > 0 for n in live["sampler_batches"]), live
    assert live["weight_loads"] > 0
    # the learner trained the model in place
    ((before, model),) = trained
    after = model.state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert run["eval_steps"] == [0, 3, 6]
    # the same outputs as the simulated mode
    for name in (
        "stability_summary.json",
        "stability_table.md",
        "stability_eval.csv",
        "stability_steps.csv",
        "stability_curves.png",
        "stability_diagnostics.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    with (tmp_path / "stability_steps.csv").open() as handle:
        steps = list(csv.DictReader(handle))
    assert len(steps) == rl_steps
    assert all(float(row["lag_max"]) <= max_lag for row in steps)
    assert json.loads((tmp_path / "stability_summary.json").read_text())["mode"] == "live"
    print(f"live run: {elapsed:.1f} s, lags {lags}, {live}")
