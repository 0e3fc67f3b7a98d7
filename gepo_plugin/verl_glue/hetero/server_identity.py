"""What rollout tagging agrees on: the switch that turns it on and the field that names a rollout's server.

``patches/server_identity.py`` tags each rollout with the server that generated it; the HeteroRL wiring turns the
patch on in every Ray process and the trainer reads the tag for per-sampler-group throughput. The names live here,
in the glue, so the patch can be deleted once verl records the server itself without touching its readers.
"""

#: ``TokenOutput.extra_fields`` key with the generating server's address.
SERVER_ID = "server_id"
#: Environment switch, set for every Ray process of a HeteroRL run (``hetero.enable=true``).
ENV = "GEPO_SERVER_IDENTITY"


def server_of(extra: object) -> str | None:
    """The server recorded in one rollout's ``extra_fields`` (a dict, or verl's NonTensorData around one), if any."""
    extra = getattr(extra, "data", extra)
    return extra.get(SERVER_ID) if isinstance(extra, dict) else None
