"""hetero.enable wiring through Hydra + prepare_config, per-sample lags, and GEPO's weight by lag bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_batch
from test_config import composed

from gepo_plugin.hetero.lag_buckets import bucket_labels, weight_stats_by_lag, weight_sums_by_lag
from gepo_plugin.hetero.lags import response_lags
from gepo_plugin.hetero.settings import HeteroConfigError, parse_hetero
from gepo_plugin.maths import group_log_expectation_from_tokens
from gepo_plugin.verl_glue.hetero.wiring import SAMPLER_NAME, SAMPLER_PATH
from gepo_plugin.verl_glue.loss_batch import build_loss_inputs, compose_actor_config
from gepo_plugin.verl_glue.response_terms import LOG_GROUP_EXPECTATION, RESPONSE_LAG, ppo_loss_with_response_terms

ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]


@pytest.mark.parametrize(("loss", "trainer"), [("gepo", "gepo_separate_async"), ("grpo", "hetero_separate_async")])
def test_enable_selects_the_plugins_sampler_and_trainer(loss, trainer):
    config = composed(f"algorithm.loss={loss}", *ASYNC, "hetero.enable=true", "hetero.max_lag=4")
    assert config.trainer.v1.trainer_mode == trainer
    assert config.trainer.v1.sampler.custom_sampler.path == SAMPLER_PATH
    assert config.trainer.v1.sampler.custom_sampler.name == SAMPLER_NAME
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.GEPO_SERVER_IDENTITY == "1"
    # verl's loader finds the class at that path
    from verl.utils.import_utils import load_extern_object

    assert load_extern_object(SAMPLER_PATH, SAMPLER_NAME).__name__ == SAMPLER_NAME


def test_disabled_changes_nothing():
    config = composed("algorithm.loss=grpo", *ASYNC)
    assert config.trainer.v1.trainer_mode == "separate_async"
    assert config.trainer.v1.sampler.custom_sampler.path is None


def test_enable_in_sync_mode_says_what_to_change():
    with pytest.raises(ValueError, match=r"trainer\.v1\.trainer_mode=separate_async"):
        composed("algorithm.loss=gepo", "hetero.enable=true")


def test_a_users_own_sampler_conflicts_clearly():
    with pytest.raises(ValueError, match=r"custom_sampler\.path"):
        composed("algorithm.loss=gepo", *ASYNC, "hetero.enable=true", "trainer.v1.sampler.custom_sampler.path=x.py")


def test_bad_hetero_values_fail_at_compose_time():
    with pytest.raises(HeteroConfigError, match="low"):
        composed(*ASYNC, "hetero.enable=true", "hetero.delay.distribution=weibull", "hetero.delay.low=10")
    with pytest.raises(HeteroConfigError, match=r"hetero\.delay\.distribution='pareto'"):
        composed(*ASYNC, "hetero.enable=true", "hetero.delay.distribution=pareto")


def test_group_sizes_must_cover_the_replicas():
    settings = parse_hetero({"sampler_groups": [2, 1]})
    assert settings.group_sizes(3) == (2, 1)
    with pytest.raises(HeteroConfigError, match="covers 3 replicas but verl starts 4"):
        settings.group_sizes(4)
    assert parse_hetero({}).group_sizes(3) == (1, 1, 1)
    with pytest.raises(HeteroConfigError, match="one per group"):
        parse_hetero({"group_delays": [{"distribution": "none"}]}).group_sizes(2)


def test_lists_per_group_are_one_rule_when_parsed_and_when_sized(tmp_path):
    """``group_delays`` and ``relay.links`` against the groups: at parse time when ``sampler_groups`` gives their
    count, else when the replicas do (``group_sizes``), with one message."""
    delays = {"group_delays": [{"distribution": "none"}]}
    expected = r"hetero\.group_delays has 1 entries for 2 sampler groups"
    with pytest.raises(HeteroConfigError, match=expected + "; give one per group"):
        parse_hetero({**delays, "sampler_groups": [1, 1]})
    with pytest.raises(HeteroConfigError, match=expected + r" \(2 replicas\); give one per group"):
        parse_hetero(delays).group_sizes(2, "2 replicas")
    relay = {"transport": "relay", "relay": {"url": str(tmp_path), "links": [{}, {}, {}]}}
    expected = r"hetero\.relay\.links has 3 entries for 2 sampler groups; give one per group"
    with pytest.raises(HeteroConfigError, match=expected):
        parse_hetero({**relay, "sampler_groups": [1, 1]})
    with pytest.raises(HeteroConfigError, match=expected):
        parse_hetero(relay).group_sizes(2)
    assert parse_hetero({**relay, "relay": {"url": str(tmp_path), "links": []}}).group_sizes(2) == (1, 1)


def test_paper_interval_builds_a_clipped_lognormal():
    settings = parse_hetero({"delay": {"distribution": "lognormal", "low": 60, "high": 1920, "confidence": 0.995}})
    model = settings.delay_for(0)
    assert model.clip_low == 60 and model.clip_high == 1920
    assert model.quantile(0.0025) == pytest.approx(60) and model.quantile(0.9975) == pytest.approx(1920)


def test_response_lags_use_the_oldest_token_of_each_group():
    keys = ["a_0_0", "a_1_0", "b_0_0", "b_1_0", "a_0_0"]
    tags = [
        {"min_global_steps": 5},
        {"min_global_steps": 3},
        {"min_global_steps": 6},
        {"min_global_steps": 6},
        {"is_padding": True},
    ]
    np.testing.assert_array_equal(response_lags(keys, tags, learner_version=6), [3, 3, 0, 0, 0])


def test_weight_stats_by_lag_match_numpy():
    rng = np.random.default_rng(0)
    log_w = rng.normal(0, 0.3, 200)
    lags = rng.integers(0, 70, 200)
    valid = rng.random(200) > 0.1
    stats = weight_stats_by_lag(torch.tensor(log_w), torch.tensor(lags), torch.tensor(valid))
    edges = [0, 1, 3, 9, 33, 10**9]
    for label, lo, hi in zip(bucket_labels(), edges, edges[1:], strict=False):
        chosen = np.exp(log_w[valid & (lags >= lo) & (lags < hi)])
        assert stats[label]["count"] == chosen.size
        assert stats[label]["fraction"] == pytest.approx(chosen.size / valid.sum(), rel=1e-12)
        assert stats[label]["mean"] == pytest.approx(chosen.mean(), rel=1e-12)
        assert stats[label]["var"] == pytest.approx(chosen.var(), rel=1e-9)
    with pytest.raises(ValueError, match="negative lag"):
        weight_stats_by_lag(torch.zeros(2), torch.tensor([0, -1]))


def test_weight_sums_report_every_bucket_even_empty_ones():
    """verl needs the same metric keys from every micro-batch of every rank: empty buckets are zeros."""
    sums = weight_sums_by_lag(torch.zeros(3), torch.tensor([0, 0, 40]))
    assert list(sums) == bucket_labels()
    assert sums["1-2"] == {"count": 0.0, "sum": 0.0, "sumsq": 0.0}
    assert sums["0"] == {"count": 2.0, "sum": 2.0, "sumsq": 2.0} and sums["33+"]["count"] == 1.0
    assert set(weight_stats_by_lag(torch.zeros(3), torch.tensor([0, 0, 40]))) == {"0", "33+"}


def test_gepo_weight_by_lag_bucket_through_verls_ppo_loss_and_metric_aggregation():
    """Two data-parallel ranks x two micro-batches whose lag buckets differ, aggregated exactly as verl 0.9.1
    does (``append_to_dict`` per rank, ``Metric.aggregate_dp`` across ranks, ``reduce_metrics`` in the trainer),
    then finalised as the HeteroRL trainer does: mean / var / fraction equal the whole step's statistics.
    (Per-bucket means emitted only where a bucket had samples crashed verl's aggregation: [2, 1] values.)"""
    from verl.utils.metric import Metric, reduce_metrics
    from verl.utils.py_functional import append_to_dict

    from gepo_plugin.hetero.lag_buckets import finalize_lag_metrics

    b = make_batch(group_sizes=(4, 4, 4, 4), seed=1, spread=0.3, shuffle=False)
    config = compose_actor_config(["strategy=fsdp2", "ppo_micro_batch_size_per_gpu=4", "policy_loss.loss_mode=gepo"])
    log_eq = group_log_expectation_from_tokens(b.old_log_prob, b.mask, b.group_ids)
    lags = torch.tensor([0.0] * 4 + [0.0] * 4 + [5.0] * 4 + [40.0] * 4)
    # rank 0: groups 0 (lag 0) and 2 (lag 5); rank 1: groups 1 (lag 0) and 3 (lag 40)
    layout = [[slice(0, 4), slice(8, 12)], [slice(4, 8), slice(12, 16)]]
    per_rank = []
    for micro_batches in layout:
        aggregated: dict = {}
        for rows in micro_batches:
            model_output, data = build_loss_inputs(
                b.log_prob[rows],
                b.old_log_prob[rows],
                b.advantages[rows],
                b.mask[rows],
                {LOG_GROUP_EXPECTATION: log_eq[rows], RESPONSE_LAG: lags[rows]},
                dp_size=2,
                batch_num_tokens=int(b.mask.sum()),
                global_batch_size=16,
            )
            _, metrics = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
            append_to_dict(aggregated, metrics)
        per_rank.append(aggregated)
    assert per_rank[0].keys() == per_rank[1].keys()
    step = {key: Metric.aggregate_dp([rank[key] for rank in per_rank]) for key in per_rank[0]}
    step = finalize_lag_metrics(reduce_metrics({key: [value] for key, value in step.items()}))

    seq_logp = (b.log_prob * b.mask).sum(-1) / b.mask.sum(-1)
    w = torch.exp(seq_logp - log_eq).double()
    for label, rows in (("0", slice(0, 8)), ("3-8", slice(8, 12)), ("33+", slice(12, 16))):
        assert step[f"actor/gepo/iw_by_lag/{label}/mean"] == pytest.approx(float(w[rows].mean()), rel=1e-6)
        assert step[f"actor/gepo/iw_by_lag/{label}/var"] == pytest.approx(float(w[rows].var(unbiased=False)), rel=1e-4)
    assert step["actor/gepo/iw_by_lag/0/fraction"] == pytest.approx(0.5)
    # the staleness guard's input: the step's ESS/N of the sequence ratio p_i / q_i, exact across ranks
    seq_ratio = torch.exp(seq_logp - (b.old_log_prob * b.mask).sum(-1) / b.mask.sum(-1)).double()
    expected_ess = float(seq_ratio.sum() ** 2 / (len(seq_ratio) * (seq_ratio**2).sum()))
    assert step["actor/gepo/ess_step"] == pytest.approx(expected_ess, rel=1e-9)
    assert not any("iw_by_lag/1-2" in key or key.endswith(("/sum", "/sumsq", "/count")) for key in step)
    # without HeteroRL's lag field there are no lag metrics
    model_output, data = build_loss_inputs(
        b.log_prob, b.old_log_prob, b.advantages, b.mask, {LOG_GROUP_EXPECTATION: log_eq}
    )
    _, metrics = ppo_loss_with_response_terms(config, model_output=model_output, data=data)
    assert not any("iw_by_lag" in key for key in metrics)


def test_hybrid_engine_off_fix_refuses_another_verl(installed_versions):
    import importlib

    from gepo_plugin.patching import PatchVersionError, apply

    installed_versions(verl="0.9.9")
    with pytest.raises(PatchVersionError, match=r"0\.9\.9"):
        apply(importlib.import_module("gepo_plugin.patches.hybrid_engine_off").PATCH)


def test_an_optional_patch_on_another_verl_warns_with_what_is_lost(monkeypatch, caplog, installed_versions):
    import logging

    from gepo_plugin import patching

    monkeypatch.setattr(patching, "APPLIED", [])
    installed_versions(verl="0.9.9")
    log = logging.getLogger("gepo_plugin.test")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert patching.apply_optional("server_identity", "per-sampler-group throughput is unavailable", log) is False
    assert "0.9.9" in caplog.text and "per-sampler-group throughput is unavailable" in caplog.text
    assert patching.applied_patches() == []


def test_every_transport_the_config_accepts_has_an_implementation_and_no_other():
    from typing import get_args

    from gepo_plugin.hetero.settings import HeteroConfig
    from gepo_plugin.verl_glue.hetero.trainer import TRANSPORTS

    assert set(TRANSPORTS) == set(get_args(HeteroConfig.model_fields["transport"].annotation))
