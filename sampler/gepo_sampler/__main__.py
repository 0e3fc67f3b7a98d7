"""``python -m gepo_sampler``: the sampler host's command (also ``gepo-sampler``)."""

from gepo_sampler.host.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
