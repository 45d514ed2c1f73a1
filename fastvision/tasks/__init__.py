"""Tasks: the seam between the generic engine and a problem. Importing this package registers
every task in ``fastvision.registry.TASKS``."""
from fastvision.tasks import classify, detect, segment  # noqa: F401  (each registers its task)
