"""A Hugging Face ``transformers`` rollout backend behind verl's rollout-server interface (``rollout.name=hf``).

verl 0.9.1's V1 trainer only generates through rollout *servers* (vLLM, SGLang, TensorRT-LLM), all of which need
a GPU; its old ``HFRollout`` does not plug into the agent loop. This package gives verl a server it can drive on a
CPU, split as verl splits ``verl/workers/rollout/vllm_rollout``, so every caller in verl (agent loop,
``LLMServerClient``/``FullyAsyncLLMServerClient``, ``CheckpointEngineManager``, the V1 trainers) works unchanged:

* :mod:`.sampling`: vLLM's sampler algorithms as pure tensor functions;
* :mod:`.server`: :class:`~.server.HFGenerationServer`, the Ray actor that generates (like ``vLLMHttpServer``),
  composed of :mod:`.settings`, :mod:`.sampling_params` (request validation), :mod:`.scheduler` (queue, gate,
  abort, drain), :mod:`.batch_generation` (KV-cache batched decoding), :mod:`.weights` and :mod:`.profiling`;
* :mod:`.replica`: :class:`~.replica.HFReplica`, the ``RolloutReplica`` verl builds (like ``vLLMReplica``), in
  HYBRID mode (weights from the ``naive`` checkpoint engine) and STANDALONE mode (weights from a checkpoint engine
  such as :mod:`gepo_plugin.cpu_backend.ray_mailbox_engine`);
* :mod:`.adapter`: :class:`~.adapter.HFServerAdapter`, the ``BaseRollout`` inside the training and
  checkpoint-engine workers that resumes, releases and updates the server;
* :mod:`.registration`: registers all of it with verl's registries as they are imported.
"""
