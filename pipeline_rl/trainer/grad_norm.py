"""The guard on the updates' gradients: DeepSpeed does not check them before an update (its
check reads every gradient tensor and waits on the device each update: trainer/model.py), so
the trainer checks the norm each update computes anyway, and stops before the weights leave it."""

from __future__ import annotations

import math


class NonFiniteGradients(RuntimeError):
    """An update was made from gradients that were not all finite."""


def finite_norms(norms: list, version: int, saved: int | None) -> list[float]:
    """The updates' gradient norms as floats; raises NonFiniteGradients if one is not finite.
    DeepSpeed does not check the gradients before an update (its check reads every gradient
    tensor and waits on the device each update: deepspeed_config), and gives a norm of -1 when
    one was inf or nan; the update is then already applied, so the run stops here, before
    the weights are published or checkpointed."""
    values = [float(n) for n in norms]
    bad = [i for i, n in enumerate(values) if not (math.isfinite(n) and n >= 0)]
    if bad:
        raise NonFiniteGradients(
            f"version {version}: the gradients of optimizer update {bad[0]} of the step were not finite "
            f"(inf or nan; gradient norms {values}); the weights are not published or checkpointed: "
            f"resume from the last checkpoint (version {saved}) after finding the cause (a loss plug-in returning inf or nan, or logprobs of -inf on trained tokens)"
        )
    return values
