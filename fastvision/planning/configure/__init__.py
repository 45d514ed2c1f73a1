"""``fastvision configure``: a 3-D segmentation recipe planned from a dataset's fingerprint and a GPU
by nnU-Net v2's rules.

``rules`` (the planning rules as pure functions), ``planner`` (:func:`configure`: geometry, the
memory fit by ``plan``'s estimator, the cluster split), ``recipe`` (the written YAML and table),
``cli`` (the subcommand).
"""
from fastvision.planning.configure.cli import add_cli
from fastvision.planning.configure.planner import configure

__all__ = ["add_cli", "configure"]
