"""``python -m fastvision`` is the ``fastvision`` command."""
import sys

from fastvision.cli import main

sys.exit(main())
