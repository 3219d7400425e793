"""Daedalus operator: reconciles RLTrainingJob resources into KubeRay RayClusters and Ray jobs (kopf).

This package never imports torch; it reads the API models from :mod:`daedalus_trainer.config`.

Modules (STYLE.md "Mapped onto Daedalus"): :mod:`~daedalus_operator.api` (every constant and name helper),
:mod:`~daedalus_operator.plan` (the pure planner), :mod:`~daedalus_operator.resources` (pure manifest builders),
:mod:`~daedalus_operator.nodes` (pure readers of nodes, pods and RayClusters), :mod:`~daedalus_operator.status`
(conditions and the status patch), :mod:`~daedalus_operator.submit` (Ray job and trainer control clients),
:mod:`~daedalus_operator.kube` (the few API calls the handlers make), :mod:`~daedalus_operator.metrics`
(Prometheus), :mod:`~daedalus_operator.handlers` (kopf), :mod:`~daedalus_operator.main` (command line).
"""
