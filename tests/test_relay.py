"""The weight relay on a real directory store: exact chains over real training, plans, integrity, auth, retention."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from relay_fixtures import FAST_RETRY, Learner, train_and_publish

from gepo_sampler.relay import codec
from gepo_sampler.relay.link import Link, LinkConfig
from gepo_sampler.relay.manifest import Manifest
from gepo_sampler.relay.publisher import (
    MANIFESTS,
    RelayPublisher,
    manifest_key,
    parse_manifest_name,
    shard_key,
)
from gepo_sampler.relay.puller import RelayIntegrityError, RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.signing import Signer, SigningKeyError, Verifier, generate_pair
from gepo_sampler.relay.store import RelayStore, RelayStoreError

SETTINGS = RelayConfig(keyframe_every=4, shard_mb=8 / 1024)


def bits(tensors: dict[str, torch.Tensor]) -> codec.WeightBits:
    return codec.WeightBits.from_tensors(tensors)


def make_store(tmp_path: Path) -> RelayStore:
    return RelayStore(str(tmp_path / "store"), retry=FAST_RETRY)


# --- the codec --------------------------------------------------------------------------------------------------


def test_delta_is_exact_for_every_bit_pattern_and_dtype() -> None:
    generator = torch.Generator().manual_seed(0)
    old = {
        "bf16": torch.randn(1000, generator=generator).to(torch.bfloat16),
        "fp32": torch.randn(40, 25, generator=generator),
        "int": torch.arange(50, dtype=torch.int64),
        "mask": torch.zeros(33, dtype=torch.bool),
    }
    new = {k: v.clone() for k, v in old.items()}
    new["bf16"][::7] = torch.tensor([float("nan"), -0.0, float("inf")]).to(torch.bfloat16).repeat(50)[:143]
    new["fp32"][3] += 1e-7
    new["int"][-1] = -5
    new["mask"][5] = True
    a, b = bits(old), bits(new)
    raw, changed = codec.encode_delta(a, b, list(a.specs))
    expected = sum(int((a.bits[n] != b.bits[n]).sum()) for n in a.specs)
    assert changed == expected > 0
    from safetensors.numpy import load

    kinds = {key.split("|")[1] for key in load(raw)}
    assert {"bitmap", "gaps"} <= kinds  # dense changes (bf16, fp32) as a bitmap, sparse ones (int) as gaps
    applied = a.copy()
    codec.apply_delta(applied, codec.decompress(codec.compress(raw, 3), True))
    assert applied.equal(b)
    for name, tensor in applied.to_tensors().items():  # the same values, bit for bit, in the original dtype
        assert tensor.dtype == new[name].dtype and tensor.shape == new[name].shape
        assert torch.equal(tensor.view(-1).view(torch.uint8), new[name].reshape(-1).view(torch.uint8))
    assert codec.encode_delta(b, b, list(b.specs))[1] == 0
    # a delta whose bitmap and values disagree is refused, not applied with values reused
    arrays = load(raw)
    arrays["bf16|xor"] = arrays["bf16|xor"][:-1]
    with pytest.raises(ValueError, match="bitmap and its values disagree"):
        codec.apply_delta(a.copy(), b"".join(codec.safetensors_pieces(arrays)))


def test_a_dense_delta_applied_in_chunks_is_exact(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(2)
    old = {"w": torch.randn(10_003, generator=generator).to(torch.bfloat16)}  # 2500 words and a tail
    new = {"w": (old["w"].float() * (1 + 0.01 * torch.randn(10_003, generator=generator))).to(torch.bfloat16)}
    a, b = bits(old), bits(new)
    raw, _ = codec.encode_delta(a, b, ["w"])
    from safetensors.numpy import load

    assert "w|bitmap" in load(raw)
    monkeypatch.setattr(codec, "_APPLY_CHUNK_WORDS", 64)  # many chunks, the last one short
    applied = a.copy()
    codec.apply_delta(applied, raw)
    assert applied.equal(b)


def test_a_keyframe_shard_is_a_safetensors_file_written_without_a_whole_copy(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    weights = {
        "embed": torch.randn(4096, 1024, generator=generator).to(torch.bfloat16),  # 8 MiB
        "norm": torch.randn(1023, generator=generator),  # an odd length: the header pads the data to 8 bytes
        "step": torch.tensor([7], dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
    }
    held = bits(weights)
    pieces = codec.encode_full(held, list(held.specs))
    from safetensors.numpy import load

    read = load(b"".join(pieces))  # safetensors itself validates the header, offsets and dtypes
    assert set(read) == set(held.bits)
    assert all(np.array_equal(read[n], held.bits[n]) and read[n].dtype == held.bits[n].dtype for n in read)

    # encoding and publishing it hashes and writes the pieces in place: no allocation near the shard's size
    import tracemalloc

    store = make_store(tmp_path)
    publisher = RelayPublisher(store, "run", RelayConfig(shard_mb=64))
    tracemalloc.start()
    try:
        publisher._put_shard(codec.encode_full(held, list(held.specs)), list(held.specs), level=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        publisher.close()
    assert peak < held.nbytes / 8, (peak, held.nbytes)
    (stored,) = [p for p in (tmp_path / "store" / "shards").iterdir()]
    assert stored.read_bytes() == b"".join(pieces)


def test_shards_respect_their_size_and_keep_every_tensor_once() -> None:
    specs = {f"t{i}": codec.TensorSpec("bfloat16", (i + 1, 100)) for i in range(30)}
    groups = codec.shard_names(specs, max_bytes=2000)
    assert [n for g in groups for n in g] == list(specs)
    for group in groups:
        assert len(group) == 1 or sum(specs[n].nbytes for n in group) <= 2000


# --- publish once, pull many ------------------------------------------------------------------------------------


def test_samplers_following_at_different_paces_hold_the_learners_exact_weights(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner = Learner(lr=1e-3)
    publisher = RelayPublisher(store, "run-a", SETTINGS)
    publisher.hold(0)  # a sampler holds version 0: retention still keeps only keyframe_every versions behind a keyframe
    manifests = {}
    every, sometimes, late = RelayPuller(store, "run-a"), RelayPuller(store, "run-a"), RelayPuller(store, "run-a")
    held = {"every": None, "sometimes": None, "late": None}
    pulled = {"every": 0, "sometimes": 0, "late": 0}
    truth: dict[int, codec.WeightBits] = {}
    for version in range(1, 26):
        learner.step()
        truth[version] = bits(learner.weights())
        publisher.publish(version, learner.weights())
        publisher.wait()
        manifests[version] = publisher.published[version]
        for name, puller, due in (
            ("every", every, True),
            ("sometimes", sometimes, version % 7 == 0),
            ("late", late, version >= 20),
        ):
            if due:
                result = puller.pull(held[name])
                held[name] = result.held
                pulled[name] += result.nbytes
                assert result.held.version == version
                assert result.held.weights.equal(truth[version]), (name, version)
    assert [v for v, m in manifests.items() if m.full is not None] == [1, 5, 9, 13, 17, 21, 25]
    assert all(m.delta is not None and m.base == v - 1 for v, m in manifests.items() if v > 1)
    # a chain follower never downloads a keyframe
    assert pulled["every"] == manifests[1].nbytes("full") + sum(
        m.nbytes("delta") for v, m in manifests.items() if v > 1
    )
    publisher.close()


def test_the_plan_is_the_cheapest_complete_chain(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner, publisher = Learner(lr=1e-2), RelayPublisher(store, "run", SETTINGS)
    puller = RelayPuller(store, "run")
    train_and_publish(learner, publisher, range(1, 10))
    held = puller.pull(None).held  # version 9, a keyframe
    publisher.hold(held.version)
    train_and_publish(learner, publisher, range(10, 17))
    manifests = puller.refresh()
    plan = puller.plan(held, 16)
    cost = sum(m.nbytes(part) for m, part in plan)
    # independently: the deltas from 9, or keyframe 13 and its deltas (retention keeps versions 9 to 16)
    assert sorted(manifests) == list(range(9, 17))
    options = {
        "deltas": sum(manifests[v].nbytes("delta") for v in range(10, 17)),
        "keyframe 13": manifests[13].nbytes("full") + sum(manifests[v].nbytes("delta") for v in range(14, 17)),
    }
    assert cost == min(options.values())
    result = puller.pull(held)
    assert result.nbytes == cost and result.held.weights.equal(bits(learner.weights()))
    publisher.close()


def test_publishing_costs_the_learner_one_host_copy_and_coalesces_when_the_store_is_slow(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    weights = {f"w{i}": torch.randn(512, 512).to(torch.bfloat16) for i in range(8)}  # 4 MiB
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=3))
    publisher.hold(0)
    copies = []
    for version in range(1, 13):
        weights = {k: (v.float() + 1e-2 * torch.randn_like(v.float())).to(torch.bfloat16) for k, v in weights.items()}
        copies.append(publisher.publish(version, weights))
    final = bits(weights)
    publisher.wait()
    counters = publisher.counters
    assert counters.get("versions_published") + counters.get("versions_coalesced") == 12
    assert max(publisher.published) == 12
    versions = sorted(publisher.published)
    for previous, version in itertools.pairwise(versions):  # a delta is against what was published
        assert publisher.published[version].base == previous
    held = RelayPuller(store, "run").pull(None).held
    assert held.version == 12 and held.weights.equal(final)
    publisher.close()


# --- integrity ---------------------------------------------------------------------------------------------------


def test_a_corrupt_or_truncated_shard_is_fetched_again_then_planned_around(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner, publisher = Learner(lr=1e-5), RelayPublisher(store, "run", SETTINGS)  # small deltas: chains win
    publisher.hold(1)
    puller = RelayPuller(store, "run")
    train_and_publish(learner, publisher, [1])
    held = puller.pull(None).held
    train_and_publish(learner, publisher, range(2, 7))
    puller.refresh()
    assert [(m.version, part) for m, part in puller.plan(held, 6)] == [(v, "delta") for v in range(2, 7)]
    root = tmp_path / "store"
    broken = publisher.published[3].delta[0]
    (root / shard_key(broken.sha256)).write_bytes(b"\x00" * broken.nbytes)  # corrupt, same size
    result = puller.pull(held)
    assert result.held.weights.equal(bits(learner.weights()))
    assert result.steps == [(5, "full"), (6, "delta")]  # fetched again, then planned around from what is held
    assert puller.corrupt_shards == {broken.sha256}  # reported by address
    assert puller.counters.get("shards_corrupt") == puller.fetch_attempts
    train_and_publish(learner, publisher, range(7, 11))
    truncated = publisher.published[7].delta[-1]
    path = root / shard_key(truncated.sha256)
    path.write_bytes(path.read_bytes()[: truncated.nbytes // 2])
    result = puller.pull(result.held)
    assert result.held.weights.equal(bits(learner.weights()))
    assert result.steps == [(9, "full"), (10, "delta")]
    assert puller.counters.get("shards_corrupt") == 2 * puller.fetch_attempts
    publisher.close()


def test_with_no_chain_left_the_learner_is_asked_for_a_keyframe(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner, publisher = Learner(), RelayPublisher(store, "run", RelayConfig(keyframe_every=100))
    publisher.hold(1)
    puller = RelayPuller(store, "run")
    train_and_publish(learner, publisher, [1])
    held = puller.pull(None).held
    first = bits(learner.weights())
    train_and_publish(learner, publisher, [2])
    for shard in publisher.published[2].delta:
        (tmp_path / "store" / shard_key(shard.sha256)).unlink()
    with pytest.raises(RelayIntegrityError) as error:
        puller.pull(held)
    assert error.value.version == 2
    assert held.version == 1 and held.weights.equal(first)  # the failed pull installed nothing
    # at once, without a new version (the learner may be waiting for this sampler's rollouts): version 2 again,
    # with a keyframe, under a second manifest
    publisher.request_keyframe()
    publisher.wait()
    assert publisher.published[2].full is not None and publisher.counters.get("keyframes_on_request") == 1
    second = sorted(name for name in store.list(MANIFESTS) if parse_manifest_name(name)[0] == 2)
    assert second == [f"0000000002-{publisher.lineage}{suffix}.json" for suffix in ("", ".k1")]
    result = puller.pull(held)
    assert result.steps == [(2, "full")] and result.held.weights.equal(bits(learner.weights()))
    # the request is answered: the next version is a delta again, and the sampler follows the chain
    train_and_publish(learner, publisher, [3])
    assert publisher.published[3].full is None
    result = puller.pull(result.held)
    assert result.steps == [(3, "delta")] and result.held.weights.equal(bits(learner.weights()))
    publisher.close()
    # a resumed run that discards version 2 and after deletes both of its manifests
    RelayPublisher(store, "run", RelayConfig(keyframe_every=100), resume_from=1).close()
    assert [parse_manifest_name(name)[0] for name in store.list(MANIFESTS)] == [1]


# --- authenticity -----------------------------------------------------------------------------------------------


def test_manifests_of_another_run_or_without_a_valid_signature_are_refused(tmp_path: Path, caplog) -> None:
    store = make_store(tmp_path)
    learner = Learner()
    learner.step()
    publisher = RelayPublisher(store, "run-a", SETTINGS, secret=b"s3cret")
    publisher.publish(1, learner.weights())
    publisher.wait()
    assert RelayPuller(store, "run-a", secret=b"s3cret").pull(None).held.version == 1
    for puller in (
        RelayPuller(store, "run-b", secret=b"s3cret"),  # another run
        RelayPuller(store, "run-a", secret=b"wrong"),  # another secret
    ):
        assert puller.pull(None) is None
        assert puller.counters.get("manifests_refused") >= 1
    assert "refusing weight version 1" in caplog.text
    # an unsigned manifest where a secret is configured, and a tampered signed one
    raw = Manifest.from_json((tmp_path / "store" / manifest_key(1, publisher.lineage)).read_text())
    unsigned = Manifest(**{**raw.__dict__, "signature": None})
    with pytest.raises(Exception, match="not signed"):
        unsigned.verify("run-a", b"s3cret")
    tampered = Manifest(**{**raw.__dict__, "version": 2})
    with pytest.raises(Exception, match="does not verify"):
        tampered.verify("run-a", b"s3cret")
    raw.verify("run-a", b"s3cret")
    publisher.close()


def test_samplers_verify_ed25519_signatures_with_the_public_key_alone(tmp_path: Path, caplog, monkeypatch) -> None:
    """The learner signs with its private key; a sampler holding only the public key pulls what the learner
    published and refuses an unsigned manifest, one signed by another key, a tampered one and another run's."""
    private, public = generate_pair()
    other_private, other_public = generate_pair()
    store = make_store(tmp_path)
    learner = Learner()
    learner.step()
    publisher = RelayPublisher(store, "run-a", SETTINGS, signer=Signer(private))
    publisher.publish(1, learner.weights())
    publisher.wait()
    pulled = RelayPuller(store, "run-a", verifier=Verifier(public)).pull(None)
    assert pulled.held.version == 1
    for name, tensor in learner.weights().items():
        assert torch.equal(pulled.held.weights.to_tensors()[name], tensor)
    for puller in (
        RelayPuller(store, "run-a", verifier=Verifier(other_public)),  # the learner's key is not this one
        RelayPuller(store, "run-b", verifier=Verifier(public)),  # another run
    ):
        assert puller.pull(None) is None and puller.counters.get("manifests_refused") >= 1
    raw = Manifest.from_json((tmp_path / "store" / manifest_key(1, publisher.lineage)).read_text())
    raw.verify("run-a", None, Verifier(public))
    with pytest.raises(Exception, match="no Ed25519 signature"):
        Manifest(**{**raw.__dict__, "ed25519": None}).verify("run-a", None, Verifier(public))
    with pytest.raises(Exception, match="does not verify with the learner's public key"):
        Manifest(**{**raw.__dict__, "version": 2}).verify("run-a", None, Verifier(public))
    forged = Manifest(**{**raw.__dict__, "ed25519": None}).signed(None, Signer(other_private))
    with pytest.raises(Exception, match="does not verify"):
        forged.verify("run-a", None, Verifier(public))
    publisher.close()
    # the config: a signing key must be the public key's, and is read from the environment only
    monkeypatch.setenv("GEPO_TEST_SIGNING_KEY", private)
    assert RelayConfig(signing_key_env="GEPO_TEST_SIGNING_KEY", public_key=public).signer().public_key == public
    with pytest.raises(SigningKeyError, match=r"is not the private key of hetero\.relay\.public_key"):
        RelayConfig(signing_key_env="GEPO_TEST_SIGNING_KEY", public_key=other_public).signer()
    with pytest.raises(ValueError, match=r"needs hetero\.relay\.public_key"):
        RelayConfig(signing_key_env="GEPO_TEST_SIGNING_KEY")
    with pytest.raises(ValueError, match=r"hetero\.relay\.public_key: the public key holds 3 bytes"):
        RelayConfig(public_key="616263")


# --- retention and resume ---------------------------------------------------------------------------------------


def test_retention_keeps_what_a_live_sampler_can_need_and_nothing_more(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner, publisher = Learner(), RelayPublisher(store, "run", SETTINGS)
    slow = RelayPuller(store, "run")
    held = None
    for version in range(1, 31):
        learner.step()
        publisher.hold(held.version if held is not None else None)
        publisher.publish(version, learner.weights())
        publisher.wait()
        if version in (3, 12, 27):
            held = slow.pull(held).held
    kept = sorted(publisher.published)
    newest_keyframe = max(v for v, m in publisher.published.items() if m.full is not None)
    assert kept[0] == min(held.version, newest_keyframe)  # 25: the newest keyframe; the slow sampler holds 27
    assert kept == list(range(kept[0], 31))
    live = {s.sha256 for m in publisher.published.values() for p in (m.full, m.delta) for s in p or ()}
    assert set(store.list("shards")) == live
    assert slow.pull(held).held.weights.equal(bits(learner.weights()))
    assert RelayPuller(store, "run").pull(None).held.weights.equal(bits(learner.weights()))  # a newcomer too
    publisher.close()


def test_a_resumed_run_continues_from_the_store_in_a_new_lineage(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner, publisher = Learner(), RelayPublisher(store, "run", SETTINGS)
    publisher.hold(0)
    puller = RelayPuller(store, "run")
    held = None
    for version in range(1, 7):
        train_and_publish(learner, publisher, [version])
        held = puller.pull(held).held  # the sampler holds version 6 of the abandoned future
    publisher.close()
    resumed_learner = Learner(seed=1)  # another trajectory from the checkpoint at version 4
    resumed = RelayPublisher(store, "run", SETTINGS, resume_from=4)
    resumed.hold(0)
    assert sorted(resumed.published) == [1, 2, 3, 4] and resumed.counters.get("versions_discarded") == 2
    resumed_learner.step()
    resumed.publish(5, resumed_learner.weights())
    resumed.wait()
    result = puller.pull(held)
    assert result.steps == [(5, "full")]  # not the delta of another lineage
    assert result.held.weights.equal(bits(resumed_learner.weights()))
    resumed.close()


# --- the link and the store ---------------------------------------------------------------------------------------


def test_a_limited_link_takes_bytes_over_bandwidth_plus_latency(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    payload = np.random.default_rng(0).bytes(400_000)
    store.put("blob", payload)
    link = Link(LinkConfig(bandwidth_mbps=16.0, latency_ms=50.0))
    started = time.perf_counter()
    assert store.get("blob", link) == payload
    took = time.perf_counter() - started
    expected = 0.05 + 400_000 * 8 / 16e6  # 0.25 s
    assert expected * 0.95 <= took <= expected + 1.0


def test_an_unusable_store_url_is_refused_with_the_url_and_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RelayStoreError, match=r"hetero\.relay\.url=.*a-file/store.*Fix"):
        RelayStore(str(blocker / "store"), retry=FAST_RETRY).probe()
    with pytest.raises(RelayStoreError, match=r"nosuchproto://x.*Fix: install the fsspec driver"):
        RelayStore("nosuchproto://x")
    RelayStore(str(tmp_path / "fine"), retry=FAST_RETRY).probe()
