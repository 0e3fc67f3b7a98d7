"""Checks for the stability lab: it learns, it respects the staleness bound, it is reproducible, it refuses nonsense.

Everything runs the ``ci`` preset (one seed, gepo and grpo at max_lag 0 and 8, 60 learner updates) or a
smaller variant of it, on one torch thread, so the whole module takes about a minute on two cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from gepo_plugin.lab import stability as st  # noqa: E402
from gepo_plugin.lab.stability_config import StabilityConfigError, resolve  # noqa: E402
from gepo_plugin.lab.stability_sim import METHODS, MethodSpec  # noqa: E402
from gepo_plugin.lab.stability_task import build_task, rewards_for  # noqa: E402

pytestmark = pytest.mark.slow


def run_lab(out: Path, preset: str = "ci", **overrides: Any) -> dict[str, Any]:
    return st.run_stability(out, resolve(preset, overrides), preset, progress=False)


#: Required rise of held-out pass@1 from the warm start to the last eval, for at least one method at lag 0.
#: Measured with the ci preset and seed 0: grpo +0.045, gepo +0.047 (seeds 1 and 2 gave grpo +0.053, +0.058),
#: against sampled-eval noise of about 0.013 (1000 answers). With lr = 0 the rise is exactly 0.
LEARNING_MARGIN = 0.03


# session-scoped: xdist interleaves other modules' tests, which would tear a module fixture down and rerun the lab
@pytest.fixture(scope="session")
def ci_run(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("stability_ci")
    return out, run_lab(out)


def test_learning_happens_on_policy(ci_run) -> None:
    _, summary = ci_run
    on_policy = [run for run in summary["runs"] if run["max_lag"] == 0]
    assert {run["method"] for run in on_policy} == {"gepo", "grpo"}
    gains = {run["method"]: run["last_eval"] - run["warm_eval"] for run in on_policy}
    assert max(gains.values()) >= LEARNING_MARGIN, gains
    warm = summary["warm_start"]["0"]
    assert 0.05 <= warm["warm_eval_accuracy"] <= 0.45, "the warm start should be weak but not useless"


def test_zero_learning_rate_does_not_improve(tmp_path: Path) -> None:
    """The control for the test above: with lr = 0 the policy and hence every (seeded) eval are unchanged."""
    summary = run_lab(tmp_path, methods=["grpo"], lags=[0], rl_steps=10, eval_every=5, lr=0.0)
    run = summary["runs"][0]
    assert run["eval_acc"] == [run["warm_eval"]] * 3


def test_lags_respect_bound_and_ledger_balances(ci_run) -> None:
    _, summary = ci_run
    for run in summary["runs"]:
        lags = run["lag_histogram"]
        assert max(lags) <= run["max_lag"], run["lag_histogram"]
        assert min(lags) >= 0
        ledger = run["ledger"]
        assert ledger["produced"] == ledger["trained"] + ledger["dropped"] + ledger["queued"]
        assert sum(lags.values()) == ledger["trained"], "every trained group's lag is recorded"
        assert ledger["trained"] >= run["eval_steps"][-1] * summary["config"]["prompts_per_step"]
    stale = [run for run in summary["runs"] if run["max_lag"] == 8]
    assert stale and all(run["lag_max"] >= 4 for run in stale), "the simulation should produce real staleness"


def test_outputs_written(ci_run) -> None:
    out, summary = ci_run
    for name in (
        "stability_summary.json",
        "stability_table.md",
        "stability_eval.csv",
        "stability_steps.csv",
        "stability_curves.png",
        "stability_diagnostics.png",
    ):
        assert (out / name).stat().st_size > 0, name
    table = (out / "stability_table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(summary["aggregate"])  # the header, then one row per (method, max_lag)
    steps = (out / "stability_steps.csv").read_text().splitlines()
    assert len(steps) == 1 + len(summary["runs"]) * summary["config"]["rl_steps"]


def test_identical_seeds_identical_results(tmp_path: Path) -> None:
    """Bitwise-equal summaries (timing aside) and CSVs, warm start included; run under the drop strategy so
    that path is covered too (a weaker warm start keeps it fast)."""
    kwargs = dict(methods=["gepo"], lags=[2], rl_steps=8, strategy="drop", warm_target=0.1)
    first = run_lab(tmp_path / "a", **kwargs)
    second = run_lab(tmp_path / "b", **kwargs)
    first.pop("timing")
    second.pop("timing")
    assert first == second
    for name in ("stability_eval.csv", "stability_steps.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    run = first["runs"][0]
    assert max(run["lag_histogram"]) <= 2
    ledger = run["ledger"]
    assert ledger["produced"] == ledger["trained"] + ledger["dropped"] + ledger["queued"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": ["ppo"]}, r"methods\[0\]='ppo'"),
        ({"lags": [-1]}, "lags are max_lag settings >= 0"),
        ({"lags": []}, "lags=\\[\\]"),
        ({"seeds": []}, "seeds"),
        ({"learning_rate": 1e-3}, "learning_rate: unknown option"),
        ({"strategy": "hope"}, "strategy='hope'"),
        ({"rl_steps": 0}, "rl_steps=0"),
        ({"prompts_per_step": 6}, "multiple of groups_per_batch"),
        ({"clip": 0.0}, "clip=0.0"),
        ({"clip": 1.5}, "clip=1.5"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"admission_margin": 1}, r"admission_margin \(1\) > max_lag \(0\)"),
        ({"time_scale": 0.1}, "only apply with live=true"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(StabilityConfigError, match=message):
        resolve("quick", kwargs)
    with pytest.raises(StabilityConfigError, match="unknown preset"):
        resolve("huge")


def test_cli_rejects_bad_values(capsys) -> None:
    with pytest.raises(SystemExit):
        st.main(["--methods", "ppo"])
    with pytest.raises(SystemExit):
        st.main(["--preset", "huge"])
    with pytest.raises(SystemExit):
        st.main(["--lags", "-3", "--out", "/nonexistent/never-written"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        st.main(["--time-scale", "0.1"])  # a live-mode option without --live
    assert exit_info.value.code == 2
    assert "only apply with live=true (--live)" in capsys.readouterr().err


def test_methods_follow_the_plugin_presets() -> None:
    specs = {name: MethodSpec.from_preset(name) for name in METHODS}
    assert specs["gepo"].loss_mode == "gepo" and specs["gepo"].needs_response_terms and not specs["gepo"].norm_by_std
    assert specs["gspo"].loss_mode == "gspo" and specs["gspo"].norm_by_std
    assert specs["grpo"].loss_mode == "vanilla" and specs["grpo"].norm_by_std
    assert specs["dr_grpo"].loss_agg_mode == "seq-mean-token-sum-norm" and not specs["dr_grpo"].norm_by_std
    assert specs["bnpo"].estimator == "bnpo"
    assert all(spec.clip_low == spec.clip_high == 0.2 for name, spec in specs.items() if name != "m2po")
    # M2PO: its bounds come from its budget, verl's clip is left alone; the lab's batch gets the mini-batch scope
    assert specs["m2po"].clip_low is None and specs["m2po"].loss_mode == "m2po" and specs["m2po"].needs_response_terms
    # GEPO+'s two lab variants: the one registered loss, its mode reaching verl's actor config
    from gepo_plugin.lab.stability_sim import actor_config_for

    for name, mode in (("gepo_plus", "hard"), ("gepo_plus_soft", "soft")):
        spec = specs[name]
        assert spec.loss_mode == "gepo_plus" and spec.needs_response_terms and spec.gepo_plus_rule().mode == mode
        assert actor_config_for(spec).policy_loss.gepo_plus_mode == mode
    assert specs["gepo"].gepo_plus_rule() is None


def test_the_guard_moves_the_labs_bound_and_every_batch_keeps_the_bound_it_was_selected_under() -> None:
    """With ESS/N thresholds at 0.99 and patience 1 the guard moves the lab's bound both ways; each batch's lags
    stay within the bound in force when it was selected (the same core as verl's buffer decides)."""
    from gepo_plugin.lab.stability_sim import RunSetup, simulate_run
    from gepo_plugin.lab.stability_task import build_policy, supervised_warm_start

    guard = {"enable": True, "min_ess": 0.99, "relax_ess": 0.99, "patience": 1, "floor": 0}
    config = resolve("ci", dict(methods=["gepo"], lags=[8], rl_steps=20, eval_every=20, lr=0.01, guard=guard))
    task = build_task(config.max_a, config.max_b, config.eval_fraction, config.task_seed)
    model = build_policy(task, 0, config.hidden, config.layers, config.heads)
    c = config
    supervised_warm_start(model, task, 0, c.warm_lr, c.warm_batch, c.warm_target, c.warm_max_steps, c.warm_check_every)
    record = simulate_run(RunSetup(model, MethodSpec.from_preset("gepo"), task, config, 8, 0))
    notes = " ".join(record.guard_changes)
    assert "tightened" in notes and "relaxed" in notes, notes
    bounds = [step["effective_max_lag"] for step in record.steps]
    assert min(bounds) < 8 and max(bounds) == 8
    for step in record.steps:
        assert step["lag_max"] <= step["effective_max_lag"], step


def test_clip_option_reaches_the_loss(tmp_path: Path) -> None:
    """--clip replaces the presets' 0.2 in verl's actor config: a tighter clip clips more tokens."""
    kwargs = dict(methods=["grpo"], lags=[8], rl_steps=12, eval_every=12)
    default = run_lab(tmp_path / "default", **kwargs)
    tight = run_lab(tmp_path / "tight", clip=0.01, **kwargs)
    assert tight["config"]["clip"] == 0.01 and default["config"]["clip"] is None
    assert tight["runs"][0]["clipfrac_mean"] > default["runs"][0]["clipfrac_mean"] + 0.05


def test_m2po_clips_only_stale_batches(tmp_path: Path) -> None:
    """The lab's m2po gets the mini-batch's cap: on-policy (p = q) no token is harmful and nothing is clipped; with
    stale batches the second moment exceeds the authors' budget and the bounds exp(+-tau) clip."""
    summary = run_lab(tmp_path, methods=["m2po"], lags=[0, 8], rl_steps=12, eval_every=12)
    clipped = {run["max_lag"]: run["clipfrac_mean"] for run in summary["runs"]}
    assert clipped[0] == 0.0 and clipped[8] > 0.01, clipped


def test_verls_rollout_correction_weighs_only_what_the_sampler_got_wrong(tmp_path: Path) -> None:
    """verl's decoupled sequence-level truncated IS, computed by verl's function on the lab's batches: on-policy the
    sampler's log-probs are the learner's, so every weight is 1 to float32 rounding; stale, they are not.

    The sampler's log-probs come from its own forwards (one per position, the last logits only) and the learner's
    from one forward of the whole response: the same weights, other kernels, so a token's log-probs differ by float32
    rounding (measured: 2.4e-6 at most) and a sequence's weight, the exponential of at most 3 of them, by about 1e-5
    at most. The weights' extremes say so; verl's ``rollout_is_std`` cannot: it is sqrt(E[w^2] - E[w]^2) in float32,
    whose cancellation leaves 0 or about sqrt(1e-9) = 4e-5 on weights within 1e-6 of 1, by the rounding of the day."""
    summary = run_lab(
        tmp_path, methods=["grpo"], lags=[0, 8], rl_steps=8, eval_every=8, rollout_correction="decoupled_seq_is"
    )
    weights = {run["max_lag"]: run["rollout_correction"] for run in summary["runs"]}
    assert weights[0]["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 1 - 1e-5 < weights[0]["rollout_corr/rollout_is_min"] <= weights[0]["rollout_corr/rollout_is_max"] < 1 + 1e-5
    assert weights[8]["rollout_corr/rollout_is_std"] > 0.03  # 0.12 when measured
    assert weights[8]["rollout_corr/rollout_is_max"] <= 2.0  # verl's truncation at its preset's threshold
    assert summary["config"]["rollout_correction"] == "decoupled_seq_is"


def test_a_rollout_correction_a_verl_run_would_ignore_is_refused() -> None:
    with pytest.raises(StabilityConfigError, match=r"bypass_pg_is.* sets rollout_is in bypass mode"):
        resolve("ci", {"rollout_correction": "bypass_pg_is"})
    with pytest.raises(StabilityConfigError, match="unknown rollout correction"):
        resolve("ci", {"rollout_correction": "seq_is"})


def test_reward_is_exact_answer_then_eos() -> None:
    task = build_task()
    vocab = {str(d): int(task.digit_ids[d]) for d in range(10)}
    eos, pad = task.eos_id, task.pad_id
    problem = int(task.train_idx[0])
    digits = [int(t) for t in task.answers[problem][: int(task.answer_lengths[problem]) - 1]]
    wrong = vocab["9"] if digits[0] != vocab["9"] else vocab["8"]
    rows = [
        [*digits, eos],  # exact
        [wrong, *digits[1:], eos],  # wrong number, well formed
        digits,  # right digits, no <eos>
    ]
    width = task.max_new_tokens
    tokens = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    problems = torch.full((3,), problem)
    assert rewards_for(task, problems, tokens).tolist() == [1.0, 0.0, 0.0]
    assert rewards_for(task, problems, tokens, format_reward=0.1).tolist() == pytest.approx([1.0, 0.1, 0.0])
