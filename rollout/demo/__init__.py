"""Demo assets for ``rollout demo``: a tiny synthetic verifiable task (see :mod:`rollout.demo.task`)."""
