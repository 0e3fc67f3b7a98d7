"""Hydra configs of the plugin (``gepo_trainer.yaml`` extends verl's ``ppo_trainer``)."""
