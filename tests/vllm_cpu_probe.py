"""A vLLM-CPU engine driven through verl's own weight-update path, outside a trainer (run as a script).

``python tests/vllm_cpu_probe.py update OUT.json``: a vLLM ``LLM`` with verl's worker extension
(``vLLMColocateWorkerExtension``) serves a tiny model whose tensors span several 1 MB buckets; twice, the script
perturbs an HF copy of the weights, sends them with verl's ``BucketedWeightSender`` over shared memory, and compares
vLLM's prompt log-probs of fixed completions with the HF model's. ``python tests/vllm_cpu_probe.py bucket OUT.json``:
a sender whose receiver attaches and then never answers (an engine that died mid-update). Either way the script
writes what it saw to ``OUT.json`` and then SIGKILLs its own process group (vLLM's engine and workers, Python's
resource tracker): a run killed the way Ray kills one, so the caller can see what is left in /dev/shm.
``GEPO_SKIP_PATCHES`` leaves the named patches out, to show each one is needed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

os.environ["VERL_PLATFORM"] = "cpu"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
PROMPTS, COMPLETIONS = [[5, 6, 7, 8], [9, 10, 11]], [[12, 13, 14], [15, 16]]
UPDATE_TIMEOUT_S = 120.0


def _hf_log_probs(model) -> list[list[float]]:
    import torch

    out = []
    with torch.no_grad():
        for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
            log_probs = torch.log_softmax(model(torch.tensor([prompt + completion])).logits.float(), -1)[0]
            out.append([log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(completion)])
    return out


def _vllm_log_probs(llm) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p + c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    outputs = llm.generate(requests, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [
        [next(iter(position.values())).logprob for position in output.prompt_logprobs[len(prompt) :]]
        for output, prompt in zip(outputs, PROMPTS, strict=True)
    ]


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def _send(sender, weights: list) -> None:
    import asyncio

    asyncio.run(sender.async_send_weights(iter(weights)))


def update(report: dict, model_dir: str) -> None:
    """Two weight updates through verl's path; the log-prob gap to HF after each (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
    from vllm import LLM

    from gepo_plugin.tiny import write_tiny_model

    path = write_tiny_model(model_dir, hidden=192, heads=6, layers=6)  # 2.7 M parameters: 11 MB in 1 MB buckets
    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=8,
        worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    report["gaps"] = [_gap(_vllm_log_probs(llm), _hf_log_probs(hf))]
    torch.manual_seed(0)
    for _ in range(2):
        with torch.no_grad():
            for parameter in hf.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        errors: list[str] = []

        def receive(errors=errors) -> None:
            try:
                llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}"[:300])

        handle = llm.collective_rpc("_get_zmq_handle")[0]
        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
        weights = [(name, tensor.detach().clone()) for name, tensor in hf.state_dict().items()]
        sending = threading.Thread(target=_send, args=(sender, weights), daemon=True)
        sending.start()
        receiver.join(UPDATE_TIMEOUT_S)
        if receiver.is_alive() or errors:
            report["error"] = errors[0] if errors else f"the update did not end within {UPDATE_TIMEOUT_S:g} s"
            return
        sending.join(UPDATE_TIMEOUT_S)
        report["gaps"].append(_gap(_vllm_log_probs(llm), _hf_log_probs(hf)))


def bucket(report: dict) -> None:
    """A sender whose receiver attaches, then never acknowledges a bucket."""
    import torch
    import verl  # noqa: F401  (the plugin's CPU backend installs itself: VERL_PLATFORM=cpu)
    import zmq
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = f"ipc:///tmp/gepo-probe-{os.getpid()}.sock"
    attached = threading.Event()

    def receiver() -> None:
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import rebuild_shared_memory

        socket = zmq.Context.instance().socket(zmq.REP)
        socket.connect(handle)
        metadata = socket.recv_pyobj()
        report["bucket"] = metadata["name"]
        report["held"] = rebuild_shared_memory(metadata["name"], metadata["size"])  # attached, as vLLM's worker does
        socket.send(b"")
        attached.set()
        socket.recv_pyobj()  # the first bucket arrives; no answer ever goes back

    threading.Thread(target=receiver, daemon=True).start()
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
    weights = [("w", torch.ones(1024))]
    threading.Thread(target=_send, args=(sender, weights), daemon=True).start()
    attached.wait(60)
    time.sleep(1.0)
    report.pop("held", None)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    report: dict = {"mode": mode}
    try:
        if mode == "update":
            update(report, sys.argv[3])
        else:
            bucket(report)
    except Exception as error:
        report["error"] = f"{type(error).__name__}: {error}"[:500]
    from gepo_plugin import patching

    report["applied"] = sorted(patching.applied_patches())
    with open(out, "w") as file:
        json.dump(report, file)
    os.killpg(os.getpgid(0), signal.SIGKILL)


if __name__ == "__main__":
    main()
