"""``python -m fastvision`` is the ``fastvision`` command."""
from fastvision.cli import entry

entry()
