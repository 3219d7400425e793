"""Daedalus operator: reconciles RLTrainingJob resources into KubeRay RayClusters and Ray jobs (kopf).

This package never imports torch; it reads the API models from :mod:`daedalus_trainer.config`.
"""
