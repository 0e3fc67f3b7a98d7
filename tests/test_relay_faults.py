"""The relay under faults, on a real directory store: a pull is all or nothing, every install is digest-checked, a
garbled manifest is refused, the store stays bounded, and a sampler's probe fails for a store that is not there."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import xxhash
from relay_fixtures import FAST_RETRY, Learner, train_and_publish

from gepo_sampler.relay import codec
from gepo_sampler.relay.manifest import MANIFESTS, manifest_key, shard_key
from gepo_sampler.relay.publisher import RelayPublisher
from gepo_sampler.relay.puller import RelayIntegrityError, RelayPuller
from gepo_sampler.relay.settings import RelayConfig
from gepo_sampler.relay.store import RelayStore, RelayStoreError


def bits(tensors: dict[str, torch.Tensor]) -> codec.WeightBits:
    return codec.WeightBits.from_tensors(tensors)


def make_store(tmp_path: Path) -> RelayStore:
    return RelayStore(str(tmp_path / "store"), retry=FAST_RETRY)


def test_a_pull_interrupted_in_the_middle_of_a_chain_leaves_the_held_version_exact(tmp_path: Path) -> None:
    """A chain of two deltas whose second shard cannot be read on the first attempt: the sampler keeps exactly the
    version it held (the learner installs nothing wrong), and the next attempt gives exactly the newest."""
    store = make_store(tmp_path)
    learner = Learner(lr=1e-3, width=256)  # about 70k parameters, every one changing at every step
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=100))
    puller = RelayPuller(store, "run")
    train_and_publish(learner, publisher, [1])
    held = puller.pull(None).held
    version_1 = held.weights.copy()
    train_and_publish(learner, publisher, [2, 3])
    puller.refresh()
    assert [(m.version, part) for m, part in puller.plan(held, 3)] == [(2, "delta"), (3, "delta")]
    (shard,) = publisher.published[3].delta
    path = tmp_path / "store" / shard_key(shard.sha256)
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()  # unreadable: a directory where the object was
    with pytest.raises(RelayStoreError):
        puller.pull(held)
    assert held.version == 1 and held.weights.equal(version_1)  # untouched, although delta 2 applied cleanly
    path.rmdir()
    path.write_bytes(saved)
    result = puller.pull(held)
    assert result.steps == [(2, "delta"), (3, "delta")]
    assert result.held.weights.equal(bits(learner.weights()))
    assert held.weights.equal(version_1)  # still: the result is a new version, not the old one written over
    publisher.close()


def test_every_manifest_carries_the_digest_of_the_versions_full_weights(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    learner = Learner()
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=3))
    for version in range(1, 6):
        train_and_publish(learner, publisher, [version])
        expected = {  # independently: xxHash3-128 of each tensor's bytes, as torch holds them
            name: xxhash.xxh3_128_hexdigest(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            for name, tensor in learner.weights().items()
        }
        assert publisher.published[version].digests == expected
    publisher.close()


def test_a_result_that_fails_its_digest_is_never_installed_and_a_keyframe_answers_it(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    store = make_store(tmp_path)
    learner = Learner(lr=1e-3)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=100))
    puller = RelayPuller(store, "run")
    train_and_publish(learner, publisher, [1])
    held = puller.pull(None).held
    version_1 = held.weights.copy()
    train_and_publish(learner, publisher, [2])
    real_apply = codec.apply_delta

    def buggy_apply(weights, data):  # a future codec bug: one bit of one changed word left unflipped
        real_apply(weights, data)
        name = codec.read_delta(data).tensors[0] if isinstance(data, bytes) else data.tensors[0]
        weights.bits[name][0] ^= 1

    monkeypatch.setattr(codec, "apply_delta", buggy_apply)
    with caplog.at_level(logging.ERROR), pytest.raises(RelayIntegrityError) as error:
        puller.pull(held)
    assert error.value.version == 2 and puller.counters.get("digest_mismatches") == 1
    assert "weight version 2" in caplog.text and "failed its digest check" in caplog.text
    assert held.weights.equal(version_1)
    publisher.request_keyframe()  # what the learner does when the sampler reports keyframe_needed
    publisher.wait()
    # the bug persists: the new publication's delta fails its digest too, and the keyframe is what gets installed
    result = puller.pull(held)
    assert result.steps == [(2, "full")] and result.held.weights.equal(bits(learner.weights()))
    assert result.held.digests == publisher.published[2].digests
    assert puller.counters.get("digest_mismatches") == 2
    publisher.close()


def test_a_garbled_manifest_is_refused_and_the_versions_around_it_stay_usable(tmp_path: Path, caplog) -> None:
    store = make_store(tmp_path)
    learner = Learner(lr=1e-4)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=4))
    publisher.hold(1)
    puller = RelayPuller(store, "run")
    train_and_publish(learner, publisher, [1])
    held = puller.pull(None).held
    truth = {}
    for version in range(2, 7):
        train_and_publish(learner, publisher, [version])
        truth[version] = bits(learner.weights())
    root = tmp_path / "store"
    middle = root / manifest_key(3, publisher.lineage)
    middle.write_bytes(middle.read_bytes()[:40])  # truncated
    newest = root / manifest_key(6, publisher.lineage)
    newest.write_text('{"format": 2, "version": "six"}')  # valid JSON, not a manifest
    with caplog.at_level(logging.ERROR):
        assert puller.latest() == 5  # the newest readable version
    assert puller.counters.get("manifests_refused") == 2
    assert manifest_key(3, publisher.lineage) in caplog.text and manifest_key(6, publisher.lineage) in caplog.text
    result = puller.pull(held)  # around version 3: the keyframe of 5
    assert result.steps == [(5, "full")] and result.held.weights.equal(truth[5])
    publisher.close()
    # a resumed learner reads the store too: it goes on past the garbled manifests
    resumed = RelayPublisher(make_store(tmp_path), "run", RelayConfig(keyframe_every=4), resume_from=6)
    assert sorted(resumed.published) == [1, 2, 4, 5] and resumed.counters.get("manifests_refused") == 2
    resumed.close()


def test_the_store_stays_bounded_whatever_a_live_sampler_holds(tmp_path: Path) -> None:
    """A sampler that stops pulling but stays alive (its group holds version 2 for ever) does not make the store
    grow: at most 2 x keyframe_every versions are kept, and the stuck sampler is served the newest keyframe."""
    every = 5
    store = make_store(tmp_path)
    learner = Learner(lr=1e-3)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=every))
    stuck = RelayPuller(store, "run")
    train_and_publish(learner, publisher, [1, 2])
    held = stuck.pull(None).held
    sizes = []
    for version in range(3, 41):
        publisher.hold(held.version)
        train_and_publish(learner, publisher, [version])
        kept = sorted(publisher.published)
        newest_keyframe = max(v for v, m in publisher.published.items() if m.full is not None)
        assert kept[0] >= newest_keyframe - every and len(kept) <= 2 * every, (version, kept)
        assert [int(name[:10]) for name in store.list(MANIFESTS)] == kept  # the store holds exactly those
        sizes.append(sum(p.stat().st_size for p in (tmp_path / "store").rglob("*") if p.is_file()))
    # the documented worst case: the kept versions' deltas and at most three keyframes
    keyframe_bytes = publisher.published[newest_keyframe].nbytes("full")
    delta_bytes = max(m.nbytes("delta") for m in publisher.published.values())
    assert max(sizes) <= 3 * keyframe_bytes + 2 * every * delta_bytes + 2 * every * 4096
    assert max(sizes[-10:]) <= 1.2 * max(sizes[10:20])  # flat once the window is full, not growing with the run
    result = stuck.pull(held)
    assert result.steps[0][1] == "full" and result.held.weights.equal(bits(learner.weights()))
    publisher.close()


def test_a_samplers_probe_fails_for_a_directory_that_is_not_there(tmp_path: Path) -> None:
    with pytest.raises(RelayStoreError, match=r"does not exist on this node.*Fix") as error:
        RelayStore(str(tmp_path / "not-mounted"), retry=FAST_RETRY).probe(write=False)
    assert error.value.permanent
    (tmp_path / "mounted").mkdir()
    RelayStore(str(tmp_path / "mounted"), retry=FAST_RETRY).probe(write=False)  # empty is fine: nothing published yet


def test_a_shard_directory_that_a_copy_tool_truncated_is_rewritten_by_the_next_keyframe(tmp_path: Path) -> None:
    """On a directory the publisher always writes a keyframe's shards afresh (write, then rename), so a damaged object
    at a reused address is replaced even without a request."""
    store = make_store(tmp_path)
    frozen = torch.randn(64, 64).to(torch.bfloat16)
    publisher = RelayPublisher(store, "run", RelayConfig(keyframe_every=2, shard_mb=4 / 1024))
    for version in range(1, 4):
        publisher.publish(version, {"frozen": frozen, "moving": torch.full((8,), float(version))})
        publisher.wait()
        if version == 1:
            (shard,) = [s for s in publisher.published[1].full if s.tensors == ("frozen",)]
            path = tmp_path / "store" / shard_key(shard.sha256)
            path.write_bytes(path.read_bytes()[:100])
    assert [s.sha256 for s in publisher.published[3].full if s.tensors == ("frozen",)] == [shard.sha256]
    held = RelayPuller(store, "run").pull(None).held
    assert torch.equal(held.weights.to_tensors()["frozen"].view(torch.int16), frozen.view(torch.int16))
    publisher.close()
