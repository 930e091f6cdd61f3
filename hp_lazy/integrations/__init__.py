"""Where stock training stacks meet hp_lazy: each module routes one library's calls that would be
wrong on a parallel model (wrapping, data sharding, clipping) to hp_lazy's own. Installed by
``hp_lazy.activate`` when the library is imported; nothing to call."""

ONLINE_TRAINERS = {"trl.trainer.grpo_trainer": "GRPOTrainer", "trl.trainer.rloo_trainer": "RLOOTrainer",
                   "trl.trainer.distillation_trainer": "DistillationTrainer"}
ONLINE_CONFIGS = {"trl.trainer.grpo_config": "GRPOConfig", "trl.trainer.rloo_config": "RLOOConfig"}
"""TRL's generating trainers and their configs, by module (:mod:`hp_lazy.integrations.trl_online`);
named here, where importing them costs no torch import, for ``activate`` to watch."""
