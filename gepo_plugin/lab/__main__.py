"""``python -m gepo_plugin.lab {stability,variance} [options]``: see :mod:`gepo_plugin.lab.cli`."""

from gepo_plugin.lab.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m gepo_plugin.lab"))
