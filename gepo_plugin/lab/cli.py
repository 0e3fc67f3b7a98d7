"""``gepo-lab``: one command line for the CPU lab's experiments.

``gepo-lab {stability,variance} [options]`` (also ``python -m gepo_plugin.lab ...``). Each sub-command
takes exactly the options of its module's own entry point (``python -m gepo_plugin.lab.stability`` /
``python -m gepo_plugin.lab.variance``), built by the same ``add_*_arguments`` functions, and runs the same
code; ``gepo-lab SUBCOMMAND --help`` lists them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gepo_plugin.lab import paired, paired_cli, stability, variance

EPILOG = """examples:
  gepo-lab variance --out lab_out/variance
  gepo-lab stability --preset ci --out lab_out/stability_ci
  gepo-lab stability --preset ci --methods gepo --lags 8 --live --time-scale 0.05
  gepo-lab paired lab_out/stability/stability_summary.json --a gepo --b gspo grpo
"""


STABILITY_DESCRIPTION = """\
Modes: by default a seeded discrete-event simulation of heterogeneous samplers and weight delays
(simulated time, reproducible bit for bit). With --live the samplers are Ray actor processes and
everything runs in wall-clock time (simulated seconds x --time-scale): same learner, staleness
rule and outputs, but NOT reproducible, and the summary JSON says "mode": "live".
Outputs in --out: stability_summary.json, stability_table.md, stability_eval.csv,
stability_steps.csv, stability_curves.png, stability_diagnostics.png."""

VARIANCE_DESCRIPTION = """\
Exact closed forms on a Bernoulli and a Gaussian grid (no sampling, about a second).
Outputs in --out: variance_bernoulli.csv, variance_gaussian.csv, variance_summary.json,
variance_table.md, figure2_bernoulli.png, figure2_gaussian.png."""


def _doc_head(doc: str | None) -> str:
    """The first paragraph of a module docstring, for a sub-command's description."""
    return (doc or "").strip().split("\n\n", 1)[0]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; appends an option's default unless its help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per lab (options from each lab's ``add_*_arguments``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="CPU lab for GEPO (arXiv 2508.17850): the paper's stability and variance claims at laptop "
        "scale. Pick an experiment; 'SUBCOMMAND --help' explains its options.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{stability,variance,paired}",
        help="stability: does each method keep its best eval score under policy lag (simulated or --live "
        "samplers); variance: Figure 2, variance of p/q vs p/E_q[q] from closed forms; paired: is one method "
        "really better than another over paired seeds (mean difference with a 95%% CI, sign test)",
    )
    stability.add_stability_arguments(
        commands.add_parser(
            "stability",
            help="training stability under staleness (simulated heterogeneous samplers, or real ones with --live)",
            description=_doc_head(stability.__doc__) + "\n\n" + STABILITY_DESCRIPTION,
            formatter_class=_HelpFormatter,
        )
    )
    variance.add_variance_arguments(
        commands.add_parser(
            "variance",
            help="Figure 2: importance-weight variance of p/q vs p/E_q[q] on toy families (closed forms, ~1 s)",
            description=_doc_head(variance.__doc__) + "\n\n" + VARIANCE_DESCRIPTION,
            formatter_class=_HelpFormatter,
        )
    )
    paired_cli.add_paired_arguments(
        commands.add_parser(
            "paired",
            help="paired comparison of two methods over seeds from stability summaries (CI and sign test)",
            description=_doc_head(paired.__doc__) + "\n\n" + paired.__doc__.strip().split("\n\n")[1],
            formatter_class=_HelpFormatter,
        )
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen lab; returns the exit status.

    Bad options exit with status 2 and a message naming the problem (argparse's ``error``).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # the sub-parser, for its error messages
    runners = {"stability": stability.run_cli, "variance": variance.run_cli, "paired": paired_cli.run_cli}
    return runners[args.command](args, sub)


if __name__ == "__main__":
    raise SystemExit(main())
