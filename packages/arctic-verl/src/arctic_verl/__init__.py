"""verl on the Arctic backend: ``pip install arctic-verl``, then run verl's own trainer with
``trainer.v1.trainer_mode=arctic``. Supported: verl >=0.9.1,<0.10.

The ``verl.plugins`` entry point (:mod:`arctic_verl.plugin`) registers the mode when verl is
imported; :class:`arctic_verl.trainer.ArcticTrainer` is the trainer it selects.
"""
