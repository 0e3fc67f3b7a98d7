"""``python -m gepo_plugin <command>``: doctor, demo, presets, keygen (a sampler host: ``python -m gepo_sampler``)."""

from __future__ import annotations

import argparse
import sys

from gepo_plugin import doctor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gepo_plugin",
        description="gepo-plugin: GEPO (arXiv 2508.17850) and its family for verl. "
        "Training itself runs through `python -m gepo_plugin.main_ppo algorithm.loss=gepo ...`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doctor.add_arguments(
        sub.add_parser(
            "doctor",
            help="check versions, verl internals and that the plugin is registered here and in a fresh Ray actor",
            description="Print installed versions, the losses/estimators/trainers the plugin registered in this "
            "process and inside a freshly started Ray actor, the patches applied, and every private verl name the "
            "plugin relies on with its status. Exits non-zero if anything the plugin needs is missing.",
        )
    )
    demo = sub.add_parser(
        "demo",
        help="one GEPO loss step through verl's real ppo_loss, groups scattered over micro-batches",
        description="Build a random batch, compute GEPO's per-prompt group term as the plugin's trainer does, "
        "run verl's ppo_loss on scattered micro-batches and check the gradient equals the whole-batch one.",
    )
    demo.add_argument("--prompts", type=int, default=4, help="number of prompts (groups) in the batch (default 4)")
    demo.add_argument("--responses", type=int, default=4, help="responses per prompt, >= 2 (default 4)")
    demo.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches the shuffled rows are split into (default 4)"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed of the synthetic batch (default 0)")
    sub.add_parser(
        "keygen",
        help="print a new Ed25519 key pair for hetero.relay.signing_key_env / hetero.relay.public_key",
        description="Print a new Ed25519 key pair (base64 of the raw keys): keep the private key in an environment "
        "variable on the learner's node only (hetero.relay.signing_key_env names it), give the public key to "
        "hetero.relay.public_key and to every sampler host (--public-key).",
    )
    sub.add_parser(
        "presets",
        help="list the algorithm.loss names and the verl settings each one applies",
        description="List every algorithm.loss preset and the verl config values it fills in.",
    )
    return parser


def print_presets() -> int:
    from gepo_plugin.verl_glue.presets import PRESETS  # lazy: a command's modules load when it runs (CLI start-up)

    for preset in PRESETS.values():
        print(f"algorithm.loss={preset.name}: {preset.summary}")
        for key, value in preset.settings.items():
            print(f"    {key}={value}")
        if preset.needs_response_terms:
            print("    trainer.v1.trainer_mode=gepo_<mode>  (the plugin's trainer hands the loss per-response terms)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor.from_args(args)
    if args.command == "demo":
        from gepo_plugin.demo import run  # lazy: torch and verl, for this command only (CLI start-up)

        return run(prompts=args.prompts, responses=args.responses, micro_batches=args.micro_batches, seed=args.seed)
    if args.command == "presets":
        return print_presets()
    if args.command == "keygen":
        from gepo_sampler.relay.signing import generate_pair  # lazy: cryptography, for this command only

        private, public = generate_pair()
        print(f"private key (learner's node only, e.g. export GEPO_RELAY_SIGNING_KEY=...): {private}")
        print(f"public key (hetero.relay.public_key, and --public-key of every sampler host): {public}")
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
