"""What a health probe runs inside a rollout server actor: is its inference engine dead? (No imports: the function
is shipped to the server by reference, and the server imports this module to run it.)"""


def engine_error(server) -> str | None:
    """Why ``server``'s inference engine is dead, or None (run inside the server actor, on its event loop).

    verl's vLLM server keeps vLLM's ``AsyncLLM`` as ``server.engine`` (a seam contact), whose ``errored`` says the
    engine-core process is gone; servers without such an engine (the plugin's CPU server) have nothing to report."""
    engine = getattr(server, "engine", None)
    if engine is None or not getattr(engine, "errored", False):
        return None
    error = getattr(engine, "dead_error", None)
    if type(error).__name__ == "SamplerQuarantined":  # a remote sampler the audit rejected (its proxy says why)
        return f"{QUARANTINED} ({error})"
    return f"{ENGINE_DIED} ({type(error).__name__ if error is not None else 'engine errored'})"


#: How a dead engine's cause starts (the prober recognises it).
ENGINE_DIED = "its inference engine died"
#: How a quarantined remote sampler's cause starts.
QUARANTINED = "quarantined by the audit"
