"""The auditor end to end below Ray: real versions in a real relay store, the real tiny model, real samplers.

The learner publishes two versions (signed with Ed25519) to a directory store; samplers generate with the tiny
model itself (transformers, float32, token by token at temperature 1) and report log-probs as vLLM does. The auditor
pulls the claimed version from the store (verified, digest-checked), recomputes by teacher forcing, and keeps each
sampler's book: an honest sampler is never quarantined over 200 audits, and each liar of the issue is quarantined
by the test that should catch it, within the audits stated.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch
from safetensors.torch import load_file

from gepo_plugin.hetero.audit.book import LOG_PROBS, SAMPLING
from gepo_plugin.hetero.audit.settings import AuditConfig
from gepo_plugin.hetero.audit.thresholds import FLOAT32_TAU
from gepo_plugin.tiny import CHARACTERS, SPECIAL_TOKENS, write_all
from gepo_plugin.verl_glue.hetero.remote.auditor import (
    AuditClient,
    AuditFailed,
    Recomputer,
    RemoteAuditor,
    SamplerQuarantined,
)
from gepo_sampler.relay.publisher import RelayPublisher
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.signing import Signer, generate_pair
from gepo_sampler.relay.store import open_store

RUN, LENGTH = "audit-run", 12
#: the tiny model's vocabulary (its embedding rows)
VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A store with versions 0 and 1 of the tiny model, and the model's path."""
    root = tmp_path_factory.mktemp("audit")
    tiny = write_all(root / "tiny")
    private, public = generate_pair()
    relay = RelayConfig(url=str(root / "store"), run_id=RUN, public_key=public)
    publisher = RelayPublisher(open_store(relay), RUN, relay, signer=Signer(private))
    base = load_file(f"{tiny['model']}/model.safetensors")
    base.setdefault("lm_head.weight", base["model.embed_tokens.weight"].clone())
    torch.manual_seed(0)
    moved = {name: tensor + 0.02 * torch.randn_like(tensor) for name, tensor in base.items()}
    for version, weights in enumerate((base, moved)):
        publisher.publish(version, weights)
        publisher.wait()
    publisher.close()
    return {"relay": relay, "public": public, "model": tiny["model"], "weights": [base, moved]}


def generate(model: Recomputer, draw_with, report_with, prompt: list[int], greedy: bool, generator) -> tuple:
    """Tokens drawn (or picked greedily) under the weights ``draw_with`` at temperature 1, and their log-probs under
    ``report_with``, as a sampler reports them (both ``(key, weights)``; an honest sampler: the same)."""
    tokens, logprobs = [], []
    for _ in range(LENGTH):
        drawn = torch.log_softmax(model.logits(*draw_with, prompt, [*tokens, 0])[-1].float(), -1)
        token = int(drawn.argmax()) if greedy else int(torch.multinomial(drawn.exp(), 1, generator=generator))
        reported = (
            drawn
            if report_with[0] == draw_with[0]
            else torch.log_softmax(model.logits(*report_with, prompt, [*tokens, 0])[-1].float(), -1)
        )
        tokens.append(token)
        logprobs.append(float(reported[token]))
    return tokens, logprobs


def auditor_for(published, samplers: list[str]) -> RemoteAuditor:
    config = AuditConfig(enable=True, fraction=1.0)
    return RemoteAuditor(config, published["relay"], published["model"], secrets.token_bytes(32), FLOAT32_TAU, samplers)


LIARS = {
    # kind: (weights drawn with, weights reported with, greedy, change to the log-probs, replayed, the test that
    # catches it, audits allowed)
    "honest": ("v1", "v1", False, None, False, None, 200),
    "stale weights claiming the newest version": ("v0", "v0", False, None, False, LOG_PROBS, 2),
    "weights with small noise": ("noisy", "noisy", False, None, False, LOG_PROBS, 2),
    "log-probs shifted": ("v1", "v1", False, lambda lp: [x - 0.01 for x in lp], False, LOG_PROBS, 2),
    "log-probs scaled": ("v1", "v1", False, lambda lp: [1.02 * x for x in lp], False, LOG_PROBS, 2),
    "an old rollout replayed for a new prompt": ("v1", "v1", False, None, True, LOG_PROBS, 4),  # the first is honest
    "greedy decoding reported as sampling": ("v1", "v1", True, None, False, SAMPLING, 10),
    "another model's tokens, log-probs recomputed honestly": ("other", "v1", False, None, False, SAMPLING, 40),
}


@pytest.mark.parametrize("kind", sorted(LIARS))
def test_the_auditor_recomputes_the_claimed_version_and_quarantines_only_liars(published, kind):
    draw_key, report_key, greedy, change, replayed, verdict, audits = LIARS[kind]
    base, moved = published["weights"]
    torch.manual_seed(5)
    variants = {
        "v0": base,
        "v1": moved,
        "noisy": {name: tensor + 1e-3 * torch.randn_like(tensor) for name, tensor in moved.items()},
        "other": {name: tensor + 0.5 * torch.randn_like(tensor) for name, tensor in moved.items()},
    }
    auditor = auditor_for(published, ["far"])
    sampler = Recomputer(published["model"])  # the sampler's own copy of the model
    generator = torch.Generator().manual_seed(1)
    found, old = None, None
    for audit in range(audits):
        prompt = [int(t) for t in torch.randint(3, 20, (5,), generator=generator)]
        draw, report = (draw_key, variants[draw_key]), (report_key, variants[report_key])
        tokens, logprobs = generate(sampler, draw, report, prompt, greedy, generator)
        if replayed:  # the first rollout, sent again for every later prompt
            old = old or (tokens, logprobs)
            tokens, logprobs = old
        if change is not None:
            logprobs = change(logprobs)
        request = {"prompt_ids": prompt, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
        result = {"request_id": f"r{audit}", "token_ids": tokens, "log_probs": logprobs, "version": 1}
        found = asyncio.run(auditor.audit("far", request, result))["verdict"]
        if found is not None:
            break
    report = auditor.report()["samplers"]["far"]
    if verdict is None:
        assert found is None and report["audits"] == audits and report["audit_failures"] == 0
        assert report["largest_gap"] < FLOAT32_TAU / 10, report  # float32 rounding only
    else:
        assert found is not None and found["test"] == verdict and found["version"] == 1, (kind, found, report)
        assert report["audits"] <= audits, report
        if verdict == LOG_PROBS:  # never on one disagreement; at the second when every audit disagrees
            assert report["audit_failures"] >= 2 and report["largest_gap"] > FLOAT32_TAU, report
            assert report["audit_failures"] == 2 or replayed, report
        else:
            assert report["audit_failures"] == 0  # its log-probs are honest: only its sampling gives it away
    print(f"{kind}: {report['audits']:.0f} audits, verdict {found and found['test']}")
    assert auditor.versions.pulls == 1  # one version claimed: pulled once, then cached


# ------------------------------------------------------------------------------------------------- in the proxy


def disagreements_to_quarantine(passed: int, alpha: float = 1e-3, p0: float = 0.01) -> int:
    """The rate test's closed form: after ``passed`` passing audits, the disagreements that reach 1/alpha."""
    import numpy as np

    from gepo_plugin.hetero.audit.sequential import RATE_STAKES

    c = np.asarray(RATE_STAKES)
    n = 1
    while np.mean((1 - c) ** passed * (1 + c * (1 - p0) / p0) ** n) < 1 / alpha:
        n += 1
    return n


class DirectAuditClient(AuditClient):
    """The proxy's audit client calling the real auditor in this process instead of through its Ray handle."""

    def _ask(self, request, result, dtype):
        return self.auditor.audit(self.sampler, request, result, dtype)


@pytest.mark.parametrize("mode", ["hold", "flag"])
def test_the_proxy_holds_audited_results_until_they_pass_and_a_verdict_quarantines_the_sampler(published, mode):
    """Through the proxy as verl calls it: honest results reach verl; a stale sampler's results disagree: with
    ``hold`` each is refused (and the one that tips the verdict fails), with ``flag`` each reaches verl; at the
    verdict the sampler is dead to the fleet (``why_dead``) and every later result fails at once."""
    from gepo_plugin.verl_glue.hetero.remote.proxy import RemoteSamplerProxy
    from gepo_sampler.remote.protocol import GenerateRequest, Result, SamplerStatus, VersionWindow
    from gepo_sampler.remote.settings import GatewayConfig

    base, moved = published["weights"]
    auditor = auditor_for(published, ["far"])
    client = DirectAuditClient("far", auditor.selection, auditor, mode=mode)
    sampler = Recomputer(published["model"])
    generator = torch.Generator().manual_seed(3)

    async def one(proxy, key: str) -> object:
        weights = {"v0": base, "v1": moved}[key]
        call = asyncio.ensure_future(proxy.generate([4, 5, 6], {"temperature": 1.0, "logprobs": True}, request_id="v"))
        work = await proxy.poll(SamplerStatus(version=1).model_dump(), wait_s=1.0)
        request = GenerateRequest(**work["requests"][0])
        tokens, logprobs = generate(sampler, (key, weights), (key, weights), request.prompt_ids, False, generator)
        result = Result(request_id=request.request_id, token_ids=tokens, log_probs=logprobs, finish_reason="stop",
                        version=1)  # fmt: skip
        await proxy.deliver({"results": [result.model_dump()]})
        try:
            return await asyncio.wait_for(call, 30)
        except Exception as error:  # what verl's agent loop would get
            return error

    async def run():
        gateway = GatewayConfig(sampler_timeout_s=60.0, request_timeout_s=60.0)
        proxy = RemoteSamplerProxy(
            "far", "remote/far", gateway, VersionWindow(first=0, latest=1), VOCAB, LENGTH, client
        )
        honest = await one(proxy, "v1")
        assert list(honest.token_ids) and proxy.why_dead() is None
        lies = []  # stale weights claiming version 1: each audit disagrees
        while proxy.why_dead() is None and len(lies) < 6:
            lies.append(await one(proxy, "v0"))
            if mode == "flag":  # its verdict follows its audit, after the result reached verl
                for _ in range(200):
                    await asyncio.sleep(0.01)
                    if client.counters["audited"] == auditor.report()["samplers"]["far"]["audits"]:
                        break
        # after one passing audit, the rate test rejects at the disagreement the closed form says
        assert len(lies) == disagreements_to_quarantine(passed=1), len(lies)
        if mode == "hold":  # nothing of a failed audit reaches verl: refused before the verdict, failed at it
            assert all(isinstance(lie, AuditFailed) for lie in lies[:-1]), lies
            assert isinstance(lies[-1], SamplerQuarantined), lies[-1]
        else:  # flagged: each reached verl; the verdict follows the audits
            assert all(list(lie.token_ids) for lie in lies), lies
        assert isinstance(proxy.why_dead(), SamplerQuarantined) and proxy.engine.errored
        later = await one(proxy, "v1")  # even an honest-looking result now: nothing more of it is trained
        assert isinstance(later, SamplerQuarantined), later
        counters = (await proxy.report())["counters"]
        assert counters["audited"] == 1 + len(lies) and counters["audit_errors"] == 0, counters  # later: not audited
        assert counters["audit_failed"] == len(lies) - 1, counters  # (the last one counts as the verdict)
        # failed for the quarantine: the one that tipped the verdict (hold) and the one answered after it
        assert counters["cut_by_quarantine"] == (2 if mode == "hold" else 1), counters

    asyncio.run(run())
    assert auditor.report()["samplers"]["far"]["quarantined"] == 1.0


def test_the_threshold_follows_the_dtype_each_sampler_reports(published):
    """Without ``hetero.audit.tau``: a float32 sampler is held to 1e-4; one in bf16 (or one that does not say) is not
    held to float32's threshold: the rate test waits, the PIT test runs."""
    config = AuditConfig(enable=True, fraction=1.0)
    auditor = RemoteAuditor(config, published["relay"], published["model"], secrets.token_bytes(32), None, ["far"])
    assert auditor.tau_for("float32") == FLOAT32_TAU
    assert auditor.tau_for("bfloat16") is None and auditor.tau_for(None) is None
    sampler = Recomputer(published["model"])
    generator = torch.Generator().manual_seed(4)
    prompt = [5, 6, 7]
    tokens, logprobs = generate(sampler, ("v0", published["weights"][0]), ("v0", published["weights"][0]), prompt,
                                False, generator)  # fmt: skip
    request = {"prompt_ids": prompt, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
    result = {"request_id": "r0", "token_ids": tokens, "log_probs": logprobs, "version": 1}  # stale: off by ~1e-2
    assert asyncio.run(auditor.audit("far", request, result, "bfloat16"))["disagreed"] is False
    assert asyncio.run(auditor.audit("far", request, {**result, "request_id": "r1"}, "float32"))["disagreed"] is True


def test_a_bf16_sampler_is_held_to_a_threshold_calibrated_on_the_runs_trusted_rollouts(published):
    """bf16: the in-cluster sampler's rollouts (trusted, same dtype) calibrate the threshold as the trainer hands them
    over; until there are enough the rate test waits. Then an honest bf16 sampler passes 200 audits and one that
    shifts its log-probs by ten times the threshold is quarantined at its second audit; the calibration survives a
    resume."""
    from gepo_plugin.hetero.audit.thresholds import trusted_needed
    from gepo_plugin.verl_glue.hetero.remote.auditor import TRUSTED

    config = AuditConfig(enable=True, fraction=1.0)

    def build() -> RemoteAuditor:  # no hetero.audit.tau: the threshold follows each sampler's dtype
        return RemoteAuditor(config, published["relay"], published["model"], b"k" * 32, None, ["honest", "liar"])

    auditor = build()
    needed = trusted_needed(config.p0, config.calibration_confidence)
    assert auditor.calibrating("bf16") == needed == 459 and auditor.tau_for("torch.bfloat16") is None
    assert auditor.calibrating("float32") == 0  # derived, never calibrated
    engine = Recomputer(published["model"])
    engine.model.to(torch.bfloat16)  # a bf16 engine: the weights are rounded when they are loaded
    moved = ("v1", published["weights"][1])
    generator = torch.Generator().manual_seed(9)

    def rollout(i: int) -> dict:
        prompt = [int(t) for t in torch.randint(3, 20, (5,), generator=generator)]
        tokens, logprobs = generate(engine, moved, moved, prompt, False, generator)
        return {"request_id": f"t{i}", "prompt_ids": prompt, "token_ids": tokens, "log_probs": logprobs,
                "version": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0}  # fmt: skip

    trusted = [rollout(i) for i in range(needed + 20)]
    assert auditor.calibrate("bfloat16", trusted[:100]) == needed - 100 and auditor.tau_for("bf16") is None
    assert auditor.calibrate("bfloat16", trusted[100:]) == 0  # the 20 beyond the need are not recomputed
    gaps = auditor.trusted["bfloat16"]
    tau = auditor.tau_for("bfloat16")
    assert len(gaps) == needed and tau == config.calibration_margin * max(gaps)
    assert tau > 10 * FLOAT32_TAU, tau  # bf16 rounding, far above float32's
    for i in range(200):
        seen = rollout(1000 + i)
        outcome = asyncio.run(auditor.audit("honest", seen, seen, "bfloat16"))
        assert outcome["verdict"] is None, (i, outcome)
    assert auditor.report()["samplers"]["honest"]["audits"] == 200
    for i in range(2):
        seen = rollout(2000 + i)
        lie = {**seen, "log_probs": [x - 10 * tau for x in seen["log_probs"]]}
        outcome = asyncio.run(auditor.audit("liar", seen, lie, "bfloat16"))
    assert outcome["verdict"] is not None and outcome["verdict"]["test"] == LOG_PROBS, outcome
    report = auditor.report()["calibration"]["bfloat16"]
    assert report == {"trusted": float(needed), "tau": tau}
    resumed = build()
    resumed.restore(auditor.state())
    assert resumed.tau_for("bfloat16") == tau and resumed.calibrating("bfloat16") == 0
    assert set(auditor.state()) == {"honest", "liar", TRUSTED}
    print(f"bf16 calibrated tau {tau:.3g} (largest trusted gap {max(gaps):.3g})")
